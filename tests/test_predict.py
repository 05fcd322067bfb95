"""python -m aamperf.predict: a run's model applied to its own samples and to a new table with ASVs it
never saw; one row per sample, the predicted UniFrac of the embeddings written, bad input one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
from conftest import CONF_DIR, free_port, read_summary, torchrun
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from aamperf.allocator import ALLOCATORS, find
from aamperf.data.collate import Collate
from aamperf.data.samples import read_samples
from aamperf.data.simulate import SimParams, ensure_simulated
from aamperf.errors import UserError
from aamperf.model.loss import predicted_unifrac
from aamperf.predict.config import register_predict_configs
from aamperf.predict.masks import hidden_bases, sequence_keys
from aamperf.predict.run import first_rows, predict
from aamperf.run import train
from aamperf.tokens import MASK
from aamperf.weights import load_model

TCMALLOC = find("tcmalloc")
needs_tcmalloc = pytest.mark.skipif(
    TCMALLOC is None, reason=f"tcmalloc is not installed here ({ALLOCATORS['tcmalloc'].install})"
)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, cache_dir):
    """A tiny run trained to completion (it keeps model.pt), and its summary."""
    from conftest import TINY
    from hydra import compose, initialize_config_dir

    from aamperf.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*TINY, f"data.cache_dir={cache_dir}"])
    run_dir = tmp_path_factory.mktemp("trained")
    return run_dir, train(cfg, run_dir)


def predicted(launch, *args, name="predict"):
    proc, out = launch(*args, name=name, module="aamperf.predict", tiny=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, read_summary(out)


def test_the_runs_own_samples_one_row_each_with_the_pairwise_unifrac_of_their_embeddings(launch, trained_run):
    run_dir, trained = trained_run
    out, summary = predicted(launch, f"run={run_dir}", "pairwise=true", "batch_size=7")
    embeddings = pd.read_csv(out / "embeddings.tsv", sep="\t", index_col=0)
    n = trained["n_train"] + trained["n_val"]  # every sample of the run's data, in the table's order
    assert summary["n_samples"] == len(embeddings) == n and embeddings.index.is_unique
    assert embeddings.shape[1] == trained["config"]["model"]["embedding_dim"]
    unifrac = np.load(out / "unifrac.npy")
    ids = (out / "unifrac.ids.txt").read_text().split()
    assert unifrac.shape == (n, n) and ids == list(embeddings.index)
    assert np.allclose(unifrac, unifrac.T) and np.all(np.diag(unifrac) == 0) and unifrac.max() < 1
    again = predicted_unifrac(torch.tensor(embeddings.to_numpy(), dtype=torch.float32)).numpy()
    assert np.allclose(unifrac, again, atol=1e-4)  # the matrix is the one of the embeddings written
    targets = pd.read_csv(out / "targets.tsv", sep="\t", index_col=0)
    assert list(targets.index) == ids and targets["observed"].notna().all()  # every sample has its target
    assert summary["target_observed"] == n and summary["target_mae"] > 0
    # in the target's own units: the model's standardized output x std + mean, sample by sample
    model, payload = load_model(run_dir)
    samples = read_samples(OmegaConf.create(payload["config"]["data"]))
    batch = Collate(samples.tokens, None, pad_to=None)([samples.dataset[i] for i in range(n)])
    # the bases hidden as the run's training hid them (predict's mask=run), pass 0's draw
    assert summary["masks"] == {"seed": payload["config"]["seed"], "fraction": 0.15, "strategy": "random"}
    hidden = hidden_bases(batch, sequence_keys(samples.tokens), 0, summary["masks"])
    with torch.no_grad():
        tokens = batch["tokens"].masked_fill(hidden, MASK)
        standard = model(tokens, batch["counts"], asv_ids=batch["asv_ids"])["target"].squeeze(1)
    scale = trained["target"]
    own_units = (standard * scale["std"] + scale["mean"]).numpy()
    assert np.allclose(targets["predicted"].to_numpy(), own_units, rtol=1e-4, atol=1e-6)
    # inference=baseline: every phase skipped, and the quality check's reference is the model itself
    assert summary["inference"] == "baseline"
    assert all(record["status"] == "skipped" for record in summary["phases"].values())
    base = summary["quality"]
    assert base["embedding_cosine_min"] == pytest.approx(1.0) and base["unifrac_mae"] == 0
    latency = summary["batch_latency_s"]
    assert summary["samples_per_s"] > 0 and latency["p95"] >= latency["p50"] > 0
    # tcmalloc preloaded where it is installed, else glibc keeping freed blocks for the next batch
    if TCMALLOC is not None:
        assert summary["allocator"]["status"] == "applied", summary["allocator"]
    else:
        assert summary["malloc"]["status"] == "applied" and summary["malloc"]["mmap_threshold"] == 2**30


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_new_table_with_new_asvs(launch, trained_run, cache_dir):
    run_dir, trained = trained_run
    # another simulated data set: another phylogeny, so sequences the model never saw
    files = ensure_simulated(SimParams(30, 64, 4, 20, 600, seed=7), cache_dir)
    out, summary = predicted(launch, f"run={run_dir}", f"data.table={files['table']}", name="new")
    embeddings = pd.read_csv(out / "embeddings.tsv", sep="\t", index_col=0)
    assert summary["n_samples"] == len(embeddings) == 30 - len(summary["too_shallow"]) > 0
    targets = pd.read_csv(out / "targets.tsv", sep="\t", index_col=0)
    assert "observed" not in targets and "target_mae" not in summary  # no metadata given: nothing to compare
    table, metadata = f"data.table={files['table']}", f"data.metadata={files['metadata']}"
    out, summary = predicted(launch, f"run={run_dir}", table, metadata, name="with_metadata")
    assert summary["target_observed"] == summary["n_samples"]


def test_predict_without_a_run_says_how_to_give_one(launch_here):
    proc, _ = launch_here(name="p", module="aamperf.predict", tiny=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: run has no value (???); give the training run to predict with: run=<its directory> "
        "(outputs/runs/..)"
    )


def test_a_run_without_a_model_is_one_line(launch_here, tmp_path):
    proc, _ = launch_here(f"run={tmp_path}", name="p", module="aamperf.predict", tiny=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: run={tmp_path} has no model.pt")


@pytest.mark.slow  # ~6 s, two launches; train's restart with tcmalloc is in the fast suite (test_allocator)
@needs_tcmalloc
def test_predict_starts_again_with_tcmalloc_in_its_own_directory_and_null_keeps_glibcs(
    launch, trained_run, tmp_path
):
    run_dir, _ = trained_run
    _, summary = predicted(launch, f"run={run_dir}", "batch_size=7", name="tcmalloc")
    allocator = summary["allocator"]
    assert allocator["status"] == "applied" and TCMALLOC in allocator["preloaded"], allocator
    assert allocator["settings"]["TCMALLOC_RELEASE_RATE"] == "0"
    assert summary["malloc"]["reason"] == "malloc is tcmalloc here: glibc's thresholds do not apply"
    _, plain = predicted(launch, f"run={run_dir}", "batch_size=7", "allocator=null", name="glibc")
    assert plain["allocator"]["reason"] == "allocator=null: malloc as the process has it (the C library's)"
    assert plain["malloc"]["status"] == "applied" and plain["malloc"]["libc"].startswith("glibc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["glibc", "tcmalloc"]  # no dated directory


def test_predict_starts_again_before_torch_is_imported(tmp_path):
    """The restart replaces the process before torch loads (1.9 s), as the command would run it."""
    script = (
        "import sys\n"
        "sys.orig_argv, sys.argv = [sys.executable, '-m', 'aamperf.predict', 'run=r'], ['p.py', 'run=r']\n"
        "import aamperf.allocator as a\n"
        "a.find = lambda name: 'libtcmalloc_minimal.so.4'\n"  # installed or not: the order is checked
        "def start_again(name, args):\n"
        "    print(name, args, 'torch' in sys.modules)\n"
        "    raise SystemExit(0)\n"
        "a._start_again = start_again\n"
        "from aamperf.predict.__main__ import cli\n"
        "cli()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("AAMPERF_ALLOCATOR_RESTARTED", "LD_PRELOAD")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["tcmalloc", "['run=r']", "False"]


def test_an_unknown_allocator_is_one_line_before_anything_is_read(launch_here, trained_run):
    run_dir, _ = trained_run
    options = {"name": "p", "module": "aamperf.predict", "tiny": False}
    proc, out = launch_here(f"run={run_dir}", "allocator=jemalloc", **options)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: allocator=jemalloc is not one of tcmalloc, or null (the process's own malloc)"
    )
    assert not (out / "summary.json").exists()


def test_a_run_of_another_model_is_refused_in_one_line_and_its_model_must_import(
    launch_here, make_cfg, tmp_path
):
    """A plug-in model (model._target_) trains and keeps model.pt; predict serves AAM and says so; a
    model whose module does not import where it is loaded names its target."""
    plugin = ["~model", "+model._target_=plugin_model.MeanPoolModel", "+model.dim=8", "data.max_asvs=16"]
    plugin += ["~loss", "+loss._target_=plugin_model.pair_loss", "+loss._partial_=true"]
    run_dir = tmp_path / "plugin"
    assert train(make_cfg(*plugin), run_dir)["status"] == "completed"
    proc, out = launch_here(f"run={run_dir}", name="p", module="aamperf.predict", tiny=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    said = f"error: run={run_dir} trained plugin_model.MeanPoolModel (model._target_), not AAM"
    assert last.startswith(said)
    assert not (out / "summary.json").exists()
    # a plug-in model is built from its file only when the caller names it again
    with pytest.raises(UserError, match=r"plugin_model\.MeanPoolModel is not aamperf's model"):
        load_model(run_dir)
    model, _ = load_model(run_dir, trust=["plugin_model.MeanPoolModel"])
    assert type(model).__name__ == "MeanPoolModel"

    payload = torch.load(run_dir / "model.pt", weights_only=True)
    payload["config"]["model"]["_target_"] = "gone_module.Net"  # moved, or not on PYTHONPATH here
    torch.save(payload, run_dir / "model.pt")
    with pytest.raises(UserError, match=r"its model gone_module\.Net cannot be built here .*on PYTHONPATH"):
        load_model(run_dir, trust=["gone_module.Net"])


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_two_ranks_write_what_one_process_writes(launch, trained_run):
    run_dir, _ = trained_run
    # in chunks of 9 samples (7 rounded up to whole batches of 3): each rank its batches of each chunk
    options = ["pairwise=true", "batch_size=3", "chunk_samples=7"]
    one, _ = predicted(launch, f"run={run_dir}", *options, name="one")
    proc, two = launch(
        f"run={run_dir}", *options, name="two", module="aamperf.predict", tiny=False, launcher=torchrun(2)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(two)
    assert summary["world_size"] == 2 and summary["n_samples"] == read_summary(one)["n_samples"]
    table_samples = summary["n_samples"] + len(summary["too_shallow"])  # chunks of the table's samples
    assert summary["chunks"] == -(-table_samples // 9) > 1
    for name in ("embeddings.tsv", "targets.tsv", "unifrac.ids.txt"):
        assert (two / name).read_text() == (one / name).read_text(), name  # the same rows, in the same order
    assert np.array_equal(np.load(two / "unifrac.npy"), np.load(one / "unifrac.npy"))
    assert not (two / "shares").exists()  # the ranks' shares were merged and removed
    # rank 0 checks its own batches of the first chunk (rows 0-2), not its rows of the next chunk too
    assert summary["quality"]["samples"] == 3 and summary["quality"]["embedding_cosine_min"] > 0.99


def test_the_quality_check_compares_only_a_ranks_outputs_of_the_first_samples():
    outputs = {"embedding": torch.zeros(6, 2)}
    assert first_rows(outputs) == 6  # one process, no share: every row in order
    assert first_rows(outputs | {"rows": torch.arange(6)}) == 6
    # rank 0 of two, chunks of 9 in batches of 3: its batch of each chunk, rows 0-2 and 9-11
    assert first_rows(outputs | {"rows": torch.tensor([0, 1, 2, 9, 10, 11])}) == 3
    assert first_rows(outputs | {"rows": torch.tensor([3, 4, 5])}) == 0  # a later rank: none


def _levels_of_two_ranks(rank: int, config: dict, run_dir: str, port: int, out: str) -> None:
    """apply_levels on two ranks of a gloo group: rank 0 measures (precision, attention) and decides
    compile from a cached trial that pays (backend eager); rank 1 must measure nothing and take them."""
    from aamperf.distributed import close_world, join_world
    from aamperf.predict import levels
    from aamperf.probe import Probe

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu, cfg = torch.device("cpu"), OmegaConf.create(config)
    world = join_world("gloo", 60, cpu)
    model, payload = load_model(Path(run_dir))
    model_cfg = OmegaConf.create(payload["config"]["model"])
    samples = read_samples(OmegaConf.create(payload["config"]["data"]))
    batch = Collate(samples.tokens, None, pad_to=None)([samples.dataset[i] for i in range(4)])
    context = levels.compile_context
    pays = {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 0.1, "graphs": 1, "under_load": None}

    def paying_trial_cached(cfg, model_cfg, batch) -> str:  # asked once precision and attention are decided
        trial = {"context": context(cfg, model_cfg, batch)}
        Probe(cpu, cfg.probe.cache).answer("compile_trial", trial, lambda: pays)
        return trial["context"]

    def measured_on_rank_1(*args, **kwargs):
        raise AssertionError("rank 1 measured the device: it must take rank 0's level")

    patched = {"compile_context": paying_trial_cached} if rank == 0 else {"Probe": measured_on_rank_1}
    with patch.multiple(levels, **patched):
        _, records = levels.apply_levels(model, cfg, cpu, model_cfg, batch, 10, world)
    close_world()
    torch.save(records, f"{out}.{rank}")


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_two_ranks_predict_with_the_level_the_first_rank_chose(trained_run, tmp_path):
    run_dir, _ = trained_run
    register_predict_configs()
    auto = ["precision=auto", "attention=auto", "compile=auto", "compile.backend=eager"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            "predict", [f"run={run_dir}", "device=cpu", *auto, f"probe.cache={tmp_path / 'p.json'}"]
        )
    config, out = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), str(tmp_path / "records")
    mp.spawn(_levels_of_two_ranks, args=(config, str(run_dir), free_port(), out), nprocs=2, join=True)
    first, second = (torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1))
    for group in ("precision", "attention"):
        assert second[group]["auto"] == first[group]["auto"], group  # rank 0's measurement, its reason
    assert first["compile"]["status"] == second["compile"]["status"] == "applied"
    assert second["compile"]["auto"] == first["compile"]["auto"]


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_the_exported_program_gives_the_models_outputs_at_other_shapes(launch, trained_run):
    run_dir, _ = trained_run
    out, summary = predicted(launch, f"run={run_dir}", "export=true", "batch_size=4", name="export")
    assert summary["export"]["file"] == "model.pt2" and "model.pt2" in summary["files"]
    assert max(summary["export"]["max_abs_diff"].values()) < 1e-5
    served = torch.export.load(out / "model.pt2").module()
    model, payload = load_model(run_dir)
    samples = read_samples(OmegaConf.create(payload["config"]["data"]))
    for size in (1, 7):  # another batch size, other widths than the batch it was exported with
        batch = Collate(samples.tokens, None, pad_to=None)([samples.dataset[i] for i in range(size)])
        with torch.no_grad():
            mine = served(batch["tokens"], batch["counts"])
            eager = model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"])
        for key in ("sample_embedding", "target"):
            assert torch.allclose(mine[key], eager[key], atol=1e-5), (size, key)


def test_each_inference_level_says_what_it_did_and_its_quality_against_fp32_eager(launch, trained_run):
    run_dir, _ = trained_run
    out, int8 = predicted(launch, f"run={run_dir}", "inference=int8", "attention=math", name="int8")
    assert (
        int8["phases"]["quantize"]["status"] == "applied" and int8["phases"]["quantize"]["linear_layers"] > 0
    )
    assert int8["phases"]["aam_ops"]["asv_rows"] == "unique"
    quality = int8["quality"]
    assert quality["samples"] == min(64, int8["n_samples"])
    # int8 weights change the numbers a little, not the answers
    assert 0.99 < quality["embedding_cosine_min"] < 1.0 and 0 < quality["unifrac_mae"] < 0.01
    assert 0 < quality["target_mae"] < 0.1 * int8["target"]["std"]


@pytest.mark.slow  # ~5.5 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_a_benchmark_sweep_ends_in_a_report_naming_the_fastest_level_that_keeps_quality(launch, trained_run):
    run_dir, _ = trained_run
    bench = ["bench.enabled=true", "bench.batch_sizes=[1,4]", "bench.warmup=1", "bench.calls=3"]
    proc, sweep = launch(
        f"run={run_dir}", "inference=baseline,int8", *bench, name="bench", module="aamperf.predict",
        tiny=False, multirun=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((sweep / "comparison.json").read_text())
    rows = {row["inference"]: row for row in result["rows"]}
    assert rows.keys() == {"baseline", "int8"} and rows["baseline"]["1"]["speedup"] == 1.0
    for row in rows.values():
        for size in ("1", "4"):
            figures = row[size]
            assert (
                0 < figures["p50_s"] <= figures["p95_s"]
                and figures["samples_per_s"] == int(size) / figures["p50_s"]
                and figures["peak_device_bytes"] is None  # a CUDA allocator's peak on a GPU only
            )
    fastest = result["fastest_keeping_quality"]
    assert rows[fastest]["keeps_quality"] and all(
        rows[fastest]["4"]["p50_s"] <= row["4"]["p50_s"] for row in rows.values() if row["keeps_quality"]
    )
    assert (
        "| int8 |" in (sweep / "comparison.md").read_text() and (sweep / "comparison.png").stat().st_size > 0
    )
    assert not list(sweep.glob("*/embeddings.tsv"))  # a benchmark writes its figures, not predictions


def test_a_table_whose_asvs_cannot_be_read_as_sequences_is_one_line(launch_here, trained_run, tmp_path):
    import biom

    run_dir, _ = trained_run
    table = biom.Table(np.array([[5, 0], [3, 9]]), ["feature_1", "feature_2"], ["A", "B"])
    path = tmp_path / "hashed.biom"
    path.write_text(table.to_json("test"))
    proc, _ = launch_here(
        f"run={run_dir}", f"data.table={path}", name="p", module="aamperf.predict", tiny=False
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.sequences: 2 observation ids of data.table are not DNA sequences")
    assert "data.sequences=<FASTA id -> sequence>" in last


@pytest.mark.parametrize("rows_a_block", [1, 5, 37])
def test_the_pairwise_matrix_written_a_block_of_rows_at_a_time_is_the_whole_one(tmp_path, rows_a_block):
    from aamperf.predict.outputs import write_pairwise

    embedding = torch.randn(37, 8, generator=torch.Generator().manual_seed(0))
    with open(tmp_path / "u.npy", "wb") as f:
        write_pairwise(f, embedding, block_bytes=4 * 37 * rows_a_block)
    matrix = np.load(tmp_path / "u.npy")
    assert matrix.shape == (37, 37) and matrix.dtype == np.float32 and np.all(np.diag(matrix) == 0)
    assert np.allclose(matrix, predicted_unifrac(embedding).numpy(), atol=1e-6)


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_table_read_a_chunk_at_a_time_gives_what_the_whole_table_gives(launch, trained_run, cache_dir):
    import biom

    run_dir, trained = trained_run
    files = ensure_simulated(SimParams(30, 64, 4, 20, 2000, seed=7), cache_dir)
    # every sample has more reads than the run's data.rarefy_depth (500), so each is drawn (its own draw,
    # in a chunk or the whole table) and none is dropped (the batches are the whole table's)
    path = files["table"]  # HDF5: a chunk reads only its samples' counts
    table = biom.load_table(str(path))
    assert table.sum(axis="sample").min() > trained["config"]["data"]["rarefy_depth"]
    common = [f"run={run_dir}", f"data.table={path}", "batch_size=4"]
    whole, one = predicted(launch, *common, "chunk_samples=0", name="whole")
    chunked, many = predicted(launch, *common, "chunk_samples=7", name="chunks")  # 8: two whole batches
    assert (one["chunks"], many["chunks"]) == (1, -(-table.shape[1] // 8))
    assert many["n_samples"] == one["n_samples"] == table.shape[1]
    for name in ("embeddings.tsv", "targets.tsv"):
        assert (chunked / name).read_text() == (whole / name).read_text(), name


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_batch_size_auto_finds_the_largest_forward_pass_that_fits(launch, trained_run):
    run_dir, _ = trained_run
    # with a level whose auto choices are measured at the batch's shapes: those of a real batch
    out, summary = predicted(launch, f"run={run_dir}", "batch_size=auto", "inference=fast", name="auto")
    found = summary["batch_finder"]
    # attention=auto timed the forward pass alone: what inference runs
    assert "SDPA forward " in summary["phases"]["attention"]["auto"]["reason"]
    # the default budget holds every sample of this tiny data set: the data limits the batch
    assert (
        found["limited_by"] == "data" and summary["batch_size"] == found["batch_size"] == summary["n_samples"]
    )
    peaks = [p["peak_bytes"] for p in found["probes"]]
    assert [p["batch"] for p in found["probes"]][:3] == [1, 2, 4] and peaks[-1] > peaks[0]
    proc, _ = launch(
        f"run={run_dir}", "batch_size=auto", "auto_batch.budget_gib=0.01", name="tiny_budget",
        module="aamperf.predict", tiny=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "batch_size=auto: not even one sample's forward pass fits" in proc.stderr.strip().splitlines()[-1]


def test_a_timeout_that_is_not_positive_is_refused_before_anything_is_read(tmp_path):
    register_predict_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", overrides=[f"run={tmp_path}", "timeout_s=0", "device=cpu"])
    with pytest.raises(UserError, match=r"^timeout_s=0 must be > 0"):
        predict(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_probe_cache_that_is_a_directory_is_refused_before_anything_is_read(tmp_path):
    register_predict_configs()
    overrides = [f"run={tmp_path}", f"probe.cache={tmp_path}", "device=cpu"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", overrides=overrides)
    with pytest.raises(UserError, match=rf"^probe.cache={tmp_path} is a directory; give a file in it"):
        predict(cfg, tmp_path / "out")


def test_a_stop_signal_ends_predict_in_one_line_with_no_file_half_written(launch, trained_run, tmp_path):
    run_dir, _ = trained_run
    new_probe = f"probe.cache={tmp_path / 'probe.json'}"  # inference=fast measures the device: seconds
    options = {"name": "p", "module": "aamperf.predict", "tiny": False, "wait": False}
    proc, out = launch(f"run={run_dir}", "inference=fast", new_probe, **options)
    deadline = time.monotonic() + 60
    # Hydra's last write before the job (the log comes first, .hydra/ after it): the command is under way
    while not (out / ".hydra" / "overrides.yaml").exists() and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"predict did not start within 60 s: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    left = "stopped before all predictions were written (each file is whole or absent): run it again"
    assert err.strip().splitlines()[-1] == f"interrupted: SIGINT received; {left}"
    assert sorted(p.name for p in out.iterdir()) == [".hydra", "predict.log"]  # no predictions


def test_the_asv_encoder_drops_its_masks_in_the_chunks_whose_asvs_are_all_full_length(trained_run, tmp_path):
    """aam_ops.unmask_full_length decided per chunk of samples: a short ASV (100 bp) only in the table's last
    sample masks the last chunk alone, and every chunk gives the masked model's embeddings."""
    import biom
    import h5py

    run_dir, trained = trained_run
    files = ensure_simulated(SimParams(30, 64, 4, 20, 2000, seed=7), tmp_path / "cache")
    table = biom.load_table(str(files["table"]))
    short = str(table.ids(axis="observation")[0])[:100]
    counts = np.zeros((1, table.shape[1]), dtype=np.int64)
    counts[0, -1] = 1500  # the last sample's most abundant ASV after rarefaction
    extra = biom.Table(counts, [short], list(table.ids()))
    path = tmp_path / "short.biom"
    with h5py.File(path, "w") as f:
        table.concat([extra], axis="observation").to_hdf5(f, "test")
    register_predict_configs()

    def run(name: str, *overrides: str) -> tuple[dict, np.ndarray]:
        common = [f"run={run_dir}", f"data.table={path}", "batch_size=4", "chunk_samples=7", "device=cpu"]
        common += [f"probe.cache={tmp_path / 'probe.json'}", "progress=false"]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("predict", overrides=[*common, *overrides])
        summary = predict(cfg, tmp_path / name)
        if "bench" in summary:  # latencies, no files
            return summary, None
        return summary, pd.read_csv(tmp_path / name / "embeddings.tsv", sep="\t", index_col=0).to_numpy()

    masked, want = run("masked")
    unmasked, got = run("unmasked", "aam_ops.unmask_full_length=true")
    record = unmasked["phases"]["aam_ops"]
    assert unmasked["chunks"] == 4 and record["asv_masks"] is True
    assert record["asv_masks_kept"].startswith("1 of 4 chunks of samples have ASVs with PAD inside")
    assert "asv_masks" not in masked["phases"]["aam_ops"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the whole table at once holds the short ASV: the masks kept, said as for a run's data
    whole, _ = run("whole", "aam_ops.unmask_full_length=true", "chunk_samples=0")
    assert whole["phases"]["aam_ops"]["asv_masks_kept"].startswith("the samples have ASVs with PAD inside")
    bench = ["bench.enabled=true", "bench.batch_sizes=[2]", "bench.warmup=0", "bench.calls=2"]
    timed, _ = run("bench", "aam_ops.unmask_full_length=true", "chunk_samples=0", *bench)  # its samples too
    assert timed["phases"]["aam_ops"]["asv_masks"] is True


def test_a_benchmark_report_tells_two_jobs_of_one_level_apart_and_names_its_reference(tmp_path):
    """Two jobs of inference=fast differing in one override: two rows labelled by it, speed-ups over the
    first job (the sweep has no baseline) and said so, the fastest named by its label."""
    import yaml

    from aamperf.predict.bench import report, to_markdown

    for num, (unmask, p50_s) in enumerate((("True", 0.02), ("False", 0.01))):
        job = tmp_path / f"{num}_job"
        (job / ".hydra").mkdir(parents=True)
        overrides = ["run=outputs/train", "inference=fast", f"aam_ops.unmask_full_length={unmask}"]
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*overrides, "bench.enabled=True"]))
        figures = {"p50_s": p50_s, "p95_s": 2 * p50_s, "samples_per_s": 32 / p50_s, "peak_rss_bytes": 2**30}
        summary = {"inference": "fast", "device": "cpu", "bench": {"32": figures}}
        summary["quality"] = {"embedding_cosine_min": 1.0, "target_mae": 0.0}
        (job / "summary.json").write_text(json.dumps(summary))
    cfg = OmegaConf.create({"bench": {"min_cosine": 0.999, "max_target_mae_std": 0.01}})
    result = report(tmp_path, cfg)
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["fast aam_ops.unmask_full_length=true", "fast aam_ops.unmask_full_length=false"]
    assert result["reference"] == labels[0] and [r["32"]["speedup"] for r in result["rows"]] == [1.0, 2.0]
    assert result["fastest_keeping_quality"] == labels[1]
    text = to_markdown(result)
    assert "(x first)" in text and f"over the first row ({labels[0]})" in text and "nan" not in text
    for num, row in enumerate(result["rows"]):  # two baselines that differ: over the first of them
        row["inference"], row["label"] = "baseline", f"baseline x={num}"
    result["reference"] = "baseline x=0"
    text = to_markdown(result)
    assert "(x baseline)" in text and "over baseline x=0, the sweep's first inference=baseline" in text


def test_a_level_predicts_the_same_numbers_every_time(trained_run, tmp_path):
    """No randomness at inference: inference=fast (SDPA swapped into the evaluated model, bf16, distinct ASVs)
    twice gives the same files, byte for byte (its attention dropped out until the swap kept eval mode)."""
    run_dir, _ = trained_run
    register_predict_configs()
    overrides = [f"run={run_dir}", "inference=fast", "precision=bf16", "attention=sdpa", "device=cpu"]
    overrides += [f"probe.cache={tmp_path / 'probe.json'}", "progress=false", "quality_samples=0"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", overrides=overrides)
    for name in ("first", "again"):
        summary = predict(cfg, tmp_path / name)
        assert summary["phases"]["attention"]["impl"] == "sdpa"
    for name in ("embeddings.tsv", "targets.tsv"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
