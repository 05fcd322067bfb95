"""torch.distributed with real processes on CPU (gloo): 2 ranks train exactly as 1 process with the batch."""

import itertools
import math
import os
import signal
import time
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import PYTHON, free_port, read_metrics, read_summary, torchrun, wait_for_steps
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.distributed import close_world, every_rank, init_world, join_world, main_decides, peer_lost
from aamperf.interrupts import Interrupts
from aamperf.launch import KILLED, SHUTDOWN_TIMEOUT_OPTION
from aamperf.phases import apply_phases, setup_phases
from aamperf.targets import learn_target

# Dropout off: its masks are drawn per rank. Everything else (nucleotide masks, batch order) does
# not depend on how the global batch is split. 8 validation samples: one val batch of 8 either way.
SAME_TRAINING = ["model.dropout=0", "data.val_fraction=0.31", "trainer.batch_size=8", "trainer.max_steps=4"]
# a classification target whose class weights differ: each rank's samples weigh differently in all
WEIGHTED_CLASSES = ["data.target=environment", "loss.class_weights=[1.0,2.0,0.5,3.0]"]
# the count head's part: each rank's share of the global batch's real ASVs
COUNT_HEAD = ["model.count_head=true"]
TARGETS = {"pretraining": [], "weighted-classes": WEIGHTED_CLASSES, "count-head": COUNT_HEAD}


def trained(launch, name, *overrides, launcher=PYTHON):
    """A run of SAME_TRAINING that must complete: (its metrics lines, its summary, its directory)."""
    # a rank that aborts (CI saw one FSDP2 rank end in "terminate called without an active exception",
    # 1 run in ~10) prints where it was: its Python stack (launch_run turns faulthandler on), and the C++
    # one of a torch error
    env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1"}
    proc, run_dir = launch(*SAME_TRAINING, *overrides, name=name, launcher=launcher, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir), read_summary(run_dir), run_dir


def values(rows, key):
    """A column of metrics.jsonl, with NaN for the nulls a non-finite value is written as."""
    return [math.nan if r[key] is None else r[key] for r in rows]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_two_ranks_train_like_one_process_with_the_whole_batch(launch, strategy):
    # DDP: NaN in a gradient at step 3, in the one process and on rank 1 only: both ranks must skip it
    poison = ["loss._target_=plugin_model.PoisonedLoss", "+loss.into=grad", "+loss.steps=[3]"]
    poison = poison if strategy == "ddp" else []
    one, _, one_dir = trained(launch, "one", *poison)
    # the profiler on the DDP run only: one CI run saw an FSDP2 rank abort at exit after profiling
    # ("terminate called without an active exception"), not reproduced locally; see the issue notes
    profile = ["metrics.profile_steps=1"] if strategy == "ddp" else []
    # FSDP finds its batch size (the 8 of the one process): the ranks agree, the probes leave no trace
    auto = ["trainer.batch_size=auto", "trainer.auto_batch.max_batch=8"] if strategy == "fsdp" else []
    poison += ["+loss.rank=1"] if poison else []
    two, summary, run_dir = trained(
        launch, "two", f"distributed={strategy}", *profile, *auto, *poison, launcher=torchrun(2)
    )
    if poison:
        assert summary["nonfinite_steps"] == 1 and [r["nonfinite_steps"] for r in two] == [0, 0, 1, 0]
    if auto:
        assert [p["batch"] for p in summary["batch_finder"]["probes"]] == [4, 8]  # multiples of 2 x 2 ranks
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    # the logged loss is the global one (every UniFrac pair of the batch), not a mean of rank means
    for key in ("loss", "loss_unifrac", "loss_nucleotide", "loss_target", "grad_norm"):
        assert values(two, key) == pytest.approx(values(one, key), rel=1e-5, nan_ok=True), key
    assert [r["val_loss"] for r in two if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in one if "val_loss" in r], rel=1e-5
    )
    assert summary["world_size"] == 2 and summary["phases"]["distributed"]["strategy"] == strategy
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]
    assert summary["peak_rss_bytes_all_ranks"] == sum(r["peak_rss_bytes"] for r in summary["per_rank"])
    pss = [r["peak_tree_pss_bytes"] for r in summary["per_rank"]]  # each rank's own process tree
    assert min(pss) > 0 and summary["peak_tree_pss_bytes_all_ranks"] == sum(pss)
    # the target's figures: of every rank's validation samples, gathered (val_predictions.tsv: rank 0's file)
    for key in ("val_target_mae", "val_target_rmse", "val_target_r2"):
        assert [r[key] for r in two if key in r] == pytest.approx([r[key] for r in one if key in r], rel=1e-4)
    files = [".hydra", "metrics.jsonl", "model.pt", "summary.json", "train.log", "train_rank1.log"]
    files += ["val_predictions.tsv", "train_samples.txt", "val_samples.txt"]  # the split, written by rank 0
    # the kept model: the whole model (FSDP2: gathered from the shards), under its plain names, trained
    # like the one process's
    mine, theirs = (torch.load(d / "model.pt", weights_only=True)["weights"] for d in (run_dir, one_dir))
    assert mine.keys() == theirs.keys()
    # but an attention pool's score bias (AttentionPooling.score: one number added to every score before a
    # softmax): its gradient is zero but for rounding, which AdamW turns into steps of up to lr, of either
    # sign (3.6e-6 apart after 4 steps on an AVX2-only EPYC, 2026-11-26)
    trained_keys = [k for k in mine if not k.endswith("score.bias")]
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-4, atol=1e-6) for k in trained_keys)
    if profile:
        assert 0 < summary["profile"]["comm_time_frac"] < 1  # the profiled step's share in collectives
        files += ["profile_trace.json", "profile_trace_rank1.json"]
    # one run record, written by rank 0; each rank its own log (and profiler trace)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(files)


@pytest.mark.slow  # two FSDP2 ranks and one process: 12 s on a 2-core Zen 4 EPYC, more on AVX2-only ones
def test_fsdp_ranks_stop_early_together_and_keep_the_best_weights_as_one_process_does(launch):
    """The first validation is the best and no later one clears min_delta: every rank stops after step 3
    (patience 2), and model.pt holds step 1's weights, gathered from the shards when they were the best."""
    best = ["trainer.val_every=1", "trainer.min_delta=1e9", "trainer.patience=2", "trainer.keep_best=true"]
    _, one, one_dir = trained(launch, "one", *best)
    _, two, run_dir = trained(launch, "two", "distributed=fsdp", *best, launcher=torchrun(2))
    assert two["steps"] == one["steps"] == 3
    assert two["best"] == {**one["best"], "value": pytest.approx(one["best"]["value"], rel=1e-5)}
    assert one["best"]["step"] == 1 and one["best"]["stopped_early_at"] == 3
    mine, theirs = (torch.load(d / "model.pt", weights_only=True)["weights"] for d in (run_dir, one_dir))
    assert mine.keys() == theirs.keys()
    trained_keys = [k for k in mine if not k.endswith("score.bias")]  # as in the test above
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-4, atol=1e-6) for k in trained_keys)


def test_distributed_without_torchrun_is_a_one_line_error(launch_here):
    proc, _ = launch_here("distributed=ddp")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: distributed=ddp needs torchrun's environment")
    assert "torchrun --nproc_per_node=2 -m aamperf.train distributed=ddp" in last


def test_no_process_per_node_is_one_line(launch):
    proc, _ = launch(launcher=torchrun(0, module="aamperf.launch"), name="zero")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: --nproc_per_node=0 must be >= 1 (processes on this node)"


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_bad_input_under_aamperf_launch_is_one_line_and_exit_2_for_the_job(launch):
    """`python -m aamperf.launch` is torchrun with aamperf's exit codes: both ranks refuse the batch (3 does
    not split over 2 ranks); the job shows that line once and exits 2, where torchrun exits 1 with its
    failure report."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    bad = ["distributed=ddp", "trainer.batch_size=3"]
    ours, _ = launch(*bad, launcher=torchrun(2, module="aamperf.launch"), env=env)
    assert ours.returncode == 2, ours.stderr[-3000:]
    lines = ours.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer.batch_size=3"), ours.stderr[-3000:]
    theirs, _ = launch(*bad, launcher=torchrun(2), env=env)
    assert theirs.returncode == 1  # torchrun's own: its report names the rank's line (its error file)
    assert lines[0] in theirs.stderr


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_the_bf16_gradient_hook_on_cpu_is_refused_before_anything_runs(launch):
    bad = ["distributed=ddp", "distributed.comm_hook=bf16"]
    proc, run_dir = launch(*bad, launcher=torchrun(2, module="aamperf.launch"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: distributed.comm_hook=bf16 needs CUDA (torch's bf16 hook runs on NCCL only); on cpu use "
        "distributed.comm_hook=fp16 or none"
    ]
    assert not run_dir.exists()  # refused before Hydra made the run directory


@pytest.mark.slow  # about 20 s of two ranks (the suite stays under 10 min)
def test_sigterm_to_aamperf_launch_stops_every_rank_after_its_step_with_a_checkpoint(launch):
    settings = ["distributed=ddp", "trainer.max_steps=500"]
    proc, run_dir = launch(*settings, launcher=torchrun(2, module="aamperf.launch"), wait=False)
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    # where each rank was, should one not say where it stopped (CI saw neither rank's line once)
    logs = "".join(f"{p.name}: ...{p.read_text()[-1500:]}\n" for p in sorted(run_dir.glob("train*.log")))
    assert proc.returncode == 143, err[-3000:] + logs
    assert "Traceback" not in err and err.count("interrupted: SIGTERM received") == 2, err[-3000:] + logs
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted"
    assert (run_dir / "checkpoints" / f"step_{summary['steps']:08d}.pt").exists()


@pytest.mark.slow  # about 15 s of two ranks
@pytest.mark.skipif(
    not SHUTDOWN_TIMEOUT_OPTION, reason="this torchrun has no --shutdown-timeout (2.11's: 30 s)"
)
def test_a_rank_killed_for_a_step_longer_than_the_shutdown_timeout_is_said_so(launch):
    settings = ["distributed=ddp", "trainer.max_steps=500"]
    settings += ["loss._target_=plugin_model.SlowLoss", "+loss.seconds=20"]
    launcher = torchrun(2, "--shutdown-timeout=1", module="aamperf.launch")
    proc, run_dir = launch(*settings, launcher=launcher, wait=False)
    wait_for_steps(proc, run_dir, 2)
    time.sleep(2.0)  # step 3 takes 20 s: SIGTERM comes in it, not at the end of step 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Unable to shutdown process" in err and "interrupted: SIGTERM received" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"interrupted: {KILLED}"
    assert not (run_dir / "checkpoints").exists()


def _stop_signals_of_two_ranks(rank: int, port: int, out: str) -> None:
    """Two ranks of a real gloo group at the ends of their steps: `Interrupts.requested` must make them
    stop after the same step whenever the signal comes, and no rank may be killed by the one signal it
    was sent. Each rank saves what `requested` answered at each step."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    all_reduce, calls = dist.all_reduce, []

    def signal_during(tensor, op):  # SIGTERM on both ranks while they wait in the first step's all-reduce
        all_reduce(tensor, op=op)
        calls.append(op)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    answers, cpu = [], torch.device("cpu")
    with Interrupts() as interrupts, patch.object(dist, "all_reduce", signal_during):
        interrupts.in_loop = True
        answers += [interrupts.requested(cpu) for _ in range(3)]  # steps 1, 2, 3
    # a run on its own: rank 0 has its signal first, rank 1 learns of it from the step's all-reduce and
    # its own signal (torchrun sends it to every rank) comes after that
    with Interrupts() as interrupts:
        interrupts.in_loop = True
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        answers.append(interrupts.requested(cpu))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the first signal this rank was sent: it must live on
        answers.append(int(interrupts.signum or 0))
    dist.destroy_process_group()
    torch.save(answers, f"{out}.{rank}")


def test_a_stop_signal_that_comes_during_the_step_end_all_reduce_is_kept_for_the_next_step(tmp_path):
    mp.spawn(_stop_signals_of_two_ranks, args=(free_port(), str(tmp_path / "answers")), nprocs=2, join=True)
    for rank in (0, 1):  # not lost: both stop after the next step; both live on to say where they stopped
        assert torch.load(tmp_path / f"answers.{rank}") == [False, True, True, True, signal.SIGTERM]


def first_step_gradients(config: dict, rank: int, world: int, port: int, out: str | None) -> dict:
    """One forward + backward of the first global batch through the real stack; the gradients after
    DDP's all-reduce (for rank 0: saved to `out`)."""
    cfg = OmegaConf.create(config)
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    device = torch.device("cpu")
    world_info = init_world(cfg, device)
    setup = setup_phases(cfg, device)
    torch.manual_seed(cfg.seed)
    data = build_data(
        cfg.data,
        batch_size=cfg.trainer.batch_size,
        seed=cfg.seed,
        loader=setup.loader,
        pad_to=setup.pad_to,
        rank=world_info.rank,
        world_size=world_info.world_size,
    )
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})  # a run's: the loss told the target, the head sized to it
    model = instantiate(cfg.model)
    plan = apply_phases(model, cfg, device, lambda *a: None, setup.records, world_info, 4)
    loss, _ = loss_fn(plan.model, to_device(next(iter(data.train_loader)), device), 1)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    close_world()
    if out is not None and rank == 0:
        torch.save(grads, out)
    return grads


def _rank_main(rank: int, config: dict, port: int, out: str) -> None:
    first_step_gradients(config, rank, 2, port, out)


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_ddp_gradients_equal_one_process_parameter_by_parameter(make_cfg, tmp_path, target):
    """A weighted cross-entropy too: the global batch's weighted mean, not the mean of the ranks' ones."""
    ddp = OmegaConf.to_container(make_cfg(*SAME_TRAINING, *target, "distributed=ddp"), resolve=True)
    single = OmegaConf.to_container(make_cfg(*SAME_TRAINING, *target), resolve=True)
    reference = first_step_gradients(single, 0, 1, 0, None)
    mp.spawn(_rank_main, args=(ddp, free_port(), str(tmp_path / "grads.pt")), nprocs=2, join=True)
    distributed = torch.load(tmp_path / "grads.pt", weights_only=True)
    assert distributed.keys() == reference.keys() and len(reference) > 20
    for name, grad in reference.items():
        torch.testing.assert_close(distributed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _join_as_rank(rank: int, config: dict, port: int):
    """(cfg, device, world, setup) of rank `rank` of 2 in a process mp.spawn started."""
    cfg = OmegaConf.create(config)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    world = init_world(cfg, device)
    return cfg, device, world, setup_phases(cfg, device)


def _auto_phases_on_two_ranks(rank: int, config: dict, port: int, out: str, how: str) -> None:
    """compile=auto and dataloader=auto decided as a torchrun job decides them, and the first step after.
    compile=auto (backend eager: no C++ compiler in the test) where compiling pays, `how` the first rank
    learns it: "cached", an earlier trial's figures (every rank compiles once it is said); "trial", its
    own trial (it times an eager step and compiles in the trial, running steps with the loss's gather,
    while the other waits for its decision, then compiles alone). dataloader=auto: only the first rank
    calibrated the peak, so only it knows the step's FLOP floor; each rank must take the first rank's
    path (a rank timing a step on its own would wait in the DDP step's all-reduce for a peer that never
    joins it)."""
    from aamperf.job import loader_workers, warmup_step
    from aamperf.phases import compile as compile_phase
    from aamperf.probe import Probe, compile_block

    cfg, device, world, setup = _join_as_rank(rank, config, port)
    torch.manual_seed(cfg.seed)
    shard = {"rank": rank, "world_size": 2, "loader": setup.loader, "pad_to": setup.pad_to}
    data = build_data(cfg.data, batch_size=8, seed=cfg.seed, **shard)  # the global batch, sliced per rank
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})  # as first_step_gradients: the data's target trained too
    model = instantiate(cfg.model)
    batches = [to_device(b, device) for b in itertools.islice(data.train_loader, 4)]  # the first: step 1's
    pays = {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 0.1, "graphs": 1, "under_load": None}
    probe = Probe(device, cfg.probe.cache)
    if rank == 0 and how == "cached":
        probe.answer("compile_trial", {"context": compile_phase.trial_context(cfg, 8)}, lambda: pays)
    if rank == 0 and how == "trial":  # the probe says a block compiles for free and runs 2x faster
        block = {"block": compile_block(cfg.model, 8, cfg.data.max_asvs), "dtype": torch.float32}
        fast = {"works": True, "block_compile_s": 0.0, "eager_block_s": 1.0, "compiled_block_s": 0.5}
        probe.answer("compile", block, lambda: {**fast, "block": block["block"], "under_load": None})

        def trial(model, cfg, step, batches):  # compiles as the real trial does; its figures say it pays
            compile_phase.apply_compile(model, cfg, lambda: step(0))
            return pays

        compile_phase.compile_trial = trial
    plan = apply_phases(model, cfg, device, warmup_step(loss_fn, batches), setup.records, world, 8)
    # making a batch: a millionth of the first rank's floor (its FLOPs at a peak of 1e9 FLOP/s)
    peak = 1e9 if rank == 0 else None
    loader_workers(cfg, setup, plan, data, loss_fn, batches[0], 1e-9, None, 1e9, peak, device, world, 10)
    loss, _ = loss_fn(plan.model, batches[0], 1)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    records = {group: plan.records[group] for group in ("compile", "dataloader")}
    close_world()
    torch.save({"grads": grads, "records": records}, f"{out}.{rank}")


@pytest.mark.parametrize("how", ["cached", "trial"])
@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_auto_phases_decided_on_two_ranks_train_like_one_process(make_cfg, tmp_path, how):
    auto = ["compile=auto", "compile.backend=eager", "dataloader=auto", f"probe.cache={tmp_path / 'p.json'}"]
    # a rank that waits for a collective its peer never joins fails the test in 30 s, not in 10 min
    ddp = make_cfg(*SAME_TRAINING, "distributed=ddp", "distributed.timeout_s=30", *auto)
    single = OmegaConf.to_container(make_cfg(*SAME_TRAINING), resolve=True)
    reference = first_step_gradients(single, 0, 1, 0, None)
    config, out = OmegaConf.to_container(ddp, resolve=True), str(tmp_path / "out")
    mp.spawn(_auto_phases_on_two_ranks, args=(config, free_port(), out, how), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{rank}", weights_only=False) for rank in (0, 1)]
    for saved in ranks:  # both compiled, both decided from the first rank's floor; the same training
        assert saved["records"]["compile"]["status"] == "applied", saved["records"]["compile"]
        assert saved["records"]["compile"]["auto"]["source"] == ("cache" if how == "cached" else "measured")
        assert "(its FLOPs at the calibrated peak)" in saved["records"]["dataloader"]["auto"]["reason"]
        assert saved["grads"].keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _loader_trial_on_two_ranks(rank: int, config: dict, port: int, out: str) -> None:
    """dataloader=auto where making a batch is half a step on the first rank (given; 2.5% of it on the
    other: each rank times its own) and the run is long: both pipelines are timed, by every rank together
    (a DDP step's all-reduce pairs the ranks' steps up)."""
    from aamperf.job import loader_workers, warmup_step

    cfg, device, world, setup = _join_as_rank(rank, config, port)
    shard = {"rank": rank, "world_size": 2, "loader": setup.loader, "pad_to": setup.pad_to}
    data = build_data(cfg.data, batch_size=8, seed=cfg.seed, **shard)
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    batches = [to_device(b, device) for b in itertools.islice(data.train_loader, 2)]
    plan = apply_phases(model, cfg, device, warmup_step(loss_fn, batches), setup.records, world, 8)
    batch_s = 0.1 if rank == 0 else 0.005
    loader_workers(cfg, setup, plan, data, loss_fn, batches[0], batch_s, 0.2, 1e9, None, device, world, 10**5)
    close_world()
    torch.save({"record": plan.records["dataloader"], "workers": setup.loader.num_workers}, f"{out}.{rank}")


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_both_loader_pipelines_are_timed_by_every_rank_together_and_the_first_decides(make_cfg, tmp_path):
    cache = f"probe.cache={tmp_path / 'p.json'}"
    plugin = ["~model", "+model._target_=plugin_model.MeanPoolModel", "+model.dim=8", "data.max_asvs=16"]
    plugin += ["~loss", "+loss._target_=plugin_model.pair_loss", "+loss._partial_=true"]  # steps of ms
    ddp = make_cfg(*plugin, "distributed=ddp", "distributed.timeout_s=30", "dataloader=auto", cache)
    config, out = OmegaConf.to_container(ddp, resolve=True), str(tmp_path / "out")
    mp.spawn(_loader_trial_on_two_ranks, args=(config, free_port(), out), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"out.{rank}", weights_only=False) for rank in (0, 1))
    assert first["record"]["auto"]["trial"]["source"] == "measured"
    assert first == second  # the first rank's figures and decision, on every rank
    assert first["workers"] == first["record"]["auto"]["chose"]


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_slurm_tasks_train_like_torchrun_ranks(launch):
    """Two tasks of a SLURM job step on one node, as srun (or hydra/launcher=slurm) starts them."""
    pytest.importorskip("submitit")
    one, _, _ = trained(launch, "one")
    env = dict(os.environ, SLURM_JOB_ID=str(free_port()), SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1")
    env.update(SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost")
    tasks = [
        launch(
            *SAME_TRAINING,
            "distributed=ddp",
            name="slurm",
            env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            wait=False,
        )
        for r in (0, 1)
    ]
    for task, _ in tasks:
        _, err = task.communicate(timeout=300)
        assert task.returncode == 0, err[-3000:]
    run_dir = tasks[0].run_dir
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["phases"]["distributed"]["backend"] == "gloo"
    rows = read_metrics(run_dir)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.slow  # about 25 s: rank 0 answers every probe of ultra on a new cache
def test_ultra_under_aamperf_launch_decides_on_rank_0_and_every_rank_trains(launch, tmp_path):
    """The command that waited 10 minutes for a collective: rank 0's compile=auto trial step gathered
    the UniFrac embeddings while rank 1 waited for the decision. With a collective timeout shorter than
    rank 0's measuring (its probes take 5 s or more on a new cache, a 4-step run's compile=auto times one
    eager step): rank 1 waits for it all the same."""
    timeout_s = 2
    new_cache = [f"probe.cache={tmp_path / 'probe.json'}", f"distributed.timeout_s={timeout_s}"]
    settings = ["distributed=ddp", "optim=ultra", "trainer.max_steps=4", *new_cache]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # as on a new machine
    proc, run_dir = launch(*settings, launcher=torchrun(2, module="aamperf.launch"), timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    assert summary["auto_s"] > timeout_s, summary["auto_s"]  # rank 1 waited past its timeout (4-5 s)
    decided = {group: record["auto"] for group, record in summary["phases"].items() if "auto" in record}
    assert {"precision", "attention", "compile", "dataloader"} <= decided.keys(), summary["phases"]
    assert all(auto["reason"] for auto in decided.values())


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_and_compile_trains_like_one_process(launch):
    """The model phases in their order (checkpointing -> compile -> shard) under FSDP2."""
    one, _, _ = trained(launch, "one")
    phases = ["distributed=fsdp", "memory=full", "compile=default"]
    two, summary, _ = trained(launch, "two", *phases, launcher=torchrun(2))
    assert {
        k: summary["phases"][k]["status"] for k in ("checkpointing", "compile", "distributed")
    } == dict.fromkeys(("checkpointing", "compile", "distributed"), "applied")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.slow
def test_a_sweep_under_aamperf_launch_joins_a_new_group_per_job_and_reports_once(launch, tmp_path):
    """Each rank runs the sweep's jobs in turn, joining a process group per job: the second job's group
    must not meet the first's addresses in the rendezvous store (a rank that did went on alone while the
    other waited for it), and the report is the first rank's alone."""
    settings = ["distributed=ddp", "optim=baseline,ultra", "trainer.max_steps=4", "distributed.timeout_s=30"]
    settings.append(f"probe.cache={tmp_path / 'probe.json'}")  # ultra measures: waits of its own
    launcher = torchrun(2, module="aamperf.launch")
    proc, sweep_dir = launch(*settings, name="sweep", launcher=launcher, multirun=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [read_summary(run) for run in sorted(sweep_dir.glob("[01]_*"))]
    assert [(s["optim"], s["world_size"], s["status"]) for s in summaries] == [
        ("baseline", 2, "completed"),
        ("ultra", 2, "completed"),
    ]
    assert proc.stdout.count("report: ") == 1 and (sweep_dir / "comparison.md").is_file()


def _long_waits_of_two_ranks(rank: int, port: int, out: str) -> None:
    """Two ranks of a real gloo group with distributed.timeout_s=1, where one works alone for longer
    (2.5 s: a first compile) while the other waits; each rank saves what it got."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_world("gloo", 1.0, torch.device("cpu"))
    got = []

    def work(seconds: float, value):
        def run():
            time.sleep(seconds)
            return value

        return run

    got.append(main_decides(work(2.5 if rank == 0 else 0.0, f"decided by {rank}")))
    got.append(every_rank(work(2.5 if rank == 1 else 0.0, f"compiled on {rank}")))

    def fails():
        raise ValueError("no C++ compiler")

    try:  # the first rank fails while deciding: the other says so at once, not after the timeout
        main_decides(fails)
    except (ValueError, dist.DistError) as exc:
        got.append(f"{type(exc).__name__}: {exc}")
        got.append(peer_lost(exc, 1.0))  # the run's one line (rank 0's error is not a lost peer: None)
    start = time.monotonic()
    if rank == 1:  # the first rank stops answering (it sleeps, never deciding): the wait ends
        try:
            main_decides(work(0.0, "never"))
        except dist.DistError as exc:
            got.append(f"{exc} after {time.monotonic() - start:.2f} s")
    else:
        time.sleep(3.0)
    close_world(completed=False)
    torch.save(got, f"{out}.{rank}")


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_rank_waits_for_another_that_works_alone_longer_than_the_timeout_and_no_longer(tmp_path):
    mp.spawn(_long_waits_of_two_ranks, args=(free_port(), str(tmp_path / "got")), nprocs=2, join=True)
    first, second = torch.load(tmp_path / "got.0"), torch.load(tmp_path / "got.1")
    assert first == ["decided by 0", "compiled on 0", "ValueError: no C++ compiler", None]
    failed = "rank 0, which failed while this rank waited for it: no C++ compiler"
    said = [f"PeerFailed: {failed}", f"rank 1: stopped with {failed}"]  # the exception, the run's line
    assert second[:4] == ["decided by 0", "compiled on 1", *said]
    line, _, seconds = second[4].partition(" after ")
    assert line == "timed out: rank 0 gave no sign of work for 1 s" and 1.0 <= float(seconds.split()[0]) < 2.0


def _cached_step_on_two_ranks(rank: int, config: dict, port: int, out: str) -> None:
    """The first step of global batch 8 in 2 micro-batches of 4 (2 a rank), as the training loop takes it
    (the step's batch drawn whole, gradient caching); the gradients after DDP's all-reduce."""
    from aamperf.trainer.gradcache import accumulation
    from aamperf.trainer.stream import BatchStream

    cfg, device, world, setup = _join_as_rank(rank, config, port)
    torch.manual_seed(cfg.seed)
    shard = {"rank": rank, "world_size": 2, "loader": setup.loader, "pad_to": setup.pad_to}
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, **shard)  # one micro-batch, both ranks
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})
    model = instantiate(cfg.model)
    plan = apply_phases(model, cfg, device, lambda *a: None, setup.records, world, 4)
    stream = BatchStream(data.train_loader)
    stream.regroup(2)
    loss, parts = accumulation(loss_fn, 2, device)(plan, to_device(next(stream), device), 1)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    close_world()
    torch.save({"grads": grads, "loss": loss, "parts": parts}, f"{out}.{rank}")


@pytest.mark.slow  # two ranks spawned: over 15 s on a 2-core AVX2-only EPYC
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_cached_micro_batches_on_two_ranks_give_the_whole_batch_s_gradients(make_cfg, tmp_path, target):
    """Every UniFrac pair of the step's 8 samples, across micro-batches and ranks: the gradients and loss
    of one process with the whole batch (dropout off: its masks are drawn per rank); a weighted
    cross-entropy over the whole batch's weights."""
    ddp = OmegaConf.to_container(make_cfg(*SAME_TRAINING, *target, "distributed=ddp"), resolve=True)
    single = OmegaConf.to_container(make_cfg(*SAME_TRAINING, *target), resolve=True)
    reference = first_step_gradients(single, 0, 1, 0, None)
    cfg = OmegaConf.create(single)
    torch.manual_seed(cfg.seed)  # the weights of first_step_gradients' model
    data = build_data(cfg.data, batch_size=8, seed=cfg.seed, loader=cfg.dataloader)
    batch = to_device(next(iter(data.train_loader)), torch.device("cpu"))
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})
    _, whole_parts = loss_fn(instantiate(cfg.model), batch, 1)
    mp.spawn(_cached_step_on_two_ranks, args=(ddp, free_port(), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert saved["grads"].keys() == reference.keys() and len(reference) > 20
        for name, grad in reference.items():
            torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        # the UniFrac part is the global batch's on every rank (the others are each rank's share)
        torch.testing.assert_close(saved["parts"]["unifrac"], whole_parts["unifrac"], rtol=1e-5, atol=1e-7)
