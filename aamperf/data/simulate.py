"""Deterministic microbiome simulator: tree, evolved sequences, environment-structured counts, target."""

import hashlib
import itertools
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import biom
import h5py
import numpy as np
from scipy import sparse
from tqdm.auto import tqdm

from aamperf.errors import NoSpace, disk_full, no_space
from aamperf.files import replace_durably, sha256_of

if TYPE_CHECKING:  # scikit-bio costs ~2 s to import; only a first run simulates
    from skbio import TreeNode

log = logging.getLogger(__name__)

SIM_VERSION = 2  # bump when the simulator or its files change, so old cached data sets are not reused
SEQUENCE_BP = 150
MEAN_BRANCH_LENGTH = 0.03  # substitutions per site: sisters differ at ~5% of sites, random pairs ~40%
FILES = {"table": "table.biom", "tree": "tree.nwk", "metadata": "metadata.tsv"}
MANIFEST = "manifest.json"  # each file's sha256, written last
PROGRESS_MIN_SAMPLES = 20_000  # a progress bar from this many samples (~10 s); small runs print nothing
SCORE_BLOCK_SAMPLES = 64  # dense block of the target's sum; a multiple of 4 (see composition_score)


@dataclass(frozen=True)
class SimParams:
    """Everything the simulated data set depends on."""

    n_samples: int
    n_asvs: int
    n_envs: int
    mean_richness: int
    depth: int
    seed: int

    def digest(self) -> str:
        text = json.dumps({"version": SIM_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_simulated(params: SimParams, cache_dir: Path) -> dict[str, Path]:
    """Paths of the simulated files in `<cache_dir>/simulated/<digest>/`, written on first use and
    verified on every use against the content hashes written beside them (`manifest.json`): a damaged
    copy (truncated, emptied, edited) is rebuilt with a warning, never read.

    Safe when several processes (e.g. torchrun ranks) start on an empty cache: each writes a temp
    directory and renames it; the first rename wins and the others use its copy.
    """
    final = cache_dir / "simulated" / params.digest()
    paths = {key: final / name for key, name in FILES.items()}
    damage = damaged(final)
    if damage is None:
        return paths
    if final.exists():
        log.warning("simulated data set in %s is damaged (%s): rebuilding it", final, damage)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        write_simulated(params, tmp)
        if damaged(final) is None:  # another process renamed its copy meanwhile
            return paths
        if final.exists():  # damaged, or files deleted by hand (a rename never leaves half a directory)
            shutil.rmtree(final)
        replace_durably(tmp, final)  # atomic: readers see no directory or a whole one
        log.info("simulated data set written to %s", final)
    except (OSError, NoSpace) as exc:
        if damaged(final) is None:  # another process won the race
            return paths
        if isinstance(exc, NoSpace) or disk_full(exc, final.parent):
            raise no_space(
                final.parent, "the simulated data set", "free space or set data.cache_dir elsewhere"
            ) from exc
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def damaged(directory: Path) -> str | None:
    """What is wrong with a simulated data set's directory (None: every file whole)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no manifest" if directory.exists() else "absent"
    for name in FILES.values():
        path = directory / name
        if not path.is_file():
            return f"{name} missing"
        if manifest.get(name) != sha256_of(path):
            return f"{name} does not match its hash"
    return None


def random_tree(n_tips: int, rng: np.random.Generator) -> "TreeNode":
    """Random bifurcating tree (uniform random joining) with exponential branch lengths."""
    from skbio import TreeNode

    nodes = [TreeNode(name=f"t{i}") for i in range(n_tips)]
    for node in nodes:
        node.length = float(rng.exponential(MEAN_BRANCH_LENGTH))
    while len(nodes) > 1:
        i, j = sorted(rng.choice(len(nodes), size=2, replace=False), reverse=True)
        left, right = nodes.pop(i), nodes.pop(j)
        parent = TreeNode(children=[left, right], length=float(rng.exponential(MEAN_BRANCH_LENGTH)))
        nodes.append(parent)
    root = nodes[0]
    root.length = None
    return root


def evolve(tree: "TreeNode", rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Jukes-Cantor evolution of a random root sequence: node id -> bases (0-3)."""
    seqs = {id(tree): rng.integers(0, 4, size=SEQUENCE_BP)}
    for node in tree.preorder(include_self=False):
        parent = seqs[id(node.parent)]
        p_change = 0.75 * (1.0 - np.exp(-4.0 * node.length / 3.0))
        changed = rng.random(SEQUENCE_BP) < p_change
        shift = rng.integers(1, 4, size=SEQUENCE_BP)  # to one of the 3 other bases, uniformly
        seqs[id(node)] = np.where(changed, (parent + shift) % 4, parent)
    return seqs


@dataclass
class World:
    """What every sample of a simulated data set is drawn from: the tree (tips named by their sequences, in
    postorder), each tip's trait, and each environment's weight on each ASV."""

    tree: "TreeNode"
    names: list[str]
    tip_trait: np.ndarray
    weights: np.ndarray  # [n_envs, n_asvs]: preference x prevalence


def simulate(params: SimParams) -> tuple[biom.Table, "TreeNode", list[tuple[str, str, float]]]:
    """The whole data set in memory: table (ids = sequences), tree (tips = sequences), metadata rows."""
    rng = np.random.default_rng(params.seed)
    world = simulate_world(params, rng)
    table, rows = draw_samples(world, params, params.n_samples, rng, "S")
    return table, world.tree, rows


def simulate_heldout(
    params: SimParams, n_samples: int, seed: int
) -> tuple[biom.Table, list[tuple[str, str, float]]]:
    """`n_samples` more samples of the data set `params` describes (ids T0001, ...): its world, new draws
    (a generator of its own, seeded by `seed`), for scoring models trained on it on samples none saw."""
    world = simulate_world(params, np.random.default_rng(params.seed))
    return draw_samples(world, params, n_samples, np.random.default_rng([params.seed, seed]), "T")


def simulate_world(params: SimParams, rng: np.random.Generator) -> World:
    """The tree, its sequences, the trait and the environments' preferences, drawn from `rng`."""
    n_asvs = params.n_asvs
    tree = random_tree(n_asvs, rng)
    seqs = evolve(tree, rng)
    tips = list(tree.tips())  # postorder: members of a clade are neighbours in this order
    names, seen = [], set()
    for tip in tips:
        bases = seqs[id(tip)].copy()
        while (name := "".join("ACGT"[b] for b in bases)) in seen:  # identical sisters: one mutation
            site = rng.integers(SEQUENCE_BP)
            bases[site] = (bases[site] + 1) % 4
        seen.add(name)
        tip.name = name
        names.append(name)
    # a trait evolved along the tree (Brownian motion): the target is its abundance-weighted mean
    trait = {id(tree): 0.0}
    for node in tree.preorder(include_self=False):
        trait[id(node)] = trait[id(node.parent)] + rng.normal(0.0, np.sqrt(node.length))
    tip_trait = np.array([trait[id(tip)] for tip in tips])

    # each environment favours a few clades: Gaussian bumps over the tip order (circular)
    position = np.arange(n_asvs)
    env_pref = np.empty((params.n_envs, n_asvs))
    for env in range(params.n_envs):
        centers = rng.integers(0, n_asvs, size=3)
        dist = np.abs(position[None, :] - centers[:, None])
        dist = np.minimum(dist, n_asvs - dist)
        env_pref[env] = np.exp(-0.5 * (dist / (0.05 * n_asvs)) ** 2).sum(0) + 0.05
    prevalence = rng.lognormal(0.0, 1.0, size=n_asvs)  # some ASVs are common everywhere
    return World(tree, names, tip_trait, env_pref * prevalence)


def draw_samples(
    world: World, params: SimParams, n_samples: int, rng: np.random.Generator, prefix: str
) -> tuple[biom.Table, list[tuple[str, str, float]]]:
    """`n_samples` samples of `world` drawn from `rng`: their table (ids = sequences) and metadata rows."""
    n_asvs, weights = params.n_asvs, world.weights
    # the same arithmetic the per-sample loop did, once per environment (bit-identical arrays)
    p_present = [w / w.sum() for w in weights]
    envs = rng.integers(0, params.n_envs, size=n_samples)
    present_of, counts_of = [], []  # per sample: ASV rows and their counts (>0), a sparse column
    for s in tqdm(range(n_samples), desc="simulate", unit="sample", disable=n_samples < PROGRESS_MIN_SAMPLES):
        richness = int(np.clip(rng.lognormal(np.log(params.mean_richness), 0.4), 5, n_asvs))
        present = rng.choice(n_asvs, size=richness, replace=False, p=p_present[envs[s]])
        abundance = rng.lognormal(0.0, 1.5, size=richness) * weights[envs[s]][present]  # heavy-tailed
        depth = max(1, int(params.depth * rng.lognormal(0.0, 0.3)))
        drawn = rng.multinomial(depth, abundance / abundance.sum())
        present_of.append(present[drawn > 0].astype(np.int32))
        counts_of.append(drawn[drawn > 0])
    indptr = np.cumsum([0] + [len(rows) for rows in present_of])
    counts = sparse.csc_matrix(
        (np.concatenate(counts_of), np.concatenate(present_of), indptr), shape=(n_asvs, n_samples)
    )
    del present_of, counts_of
    score = composition_score(counts, world.tip_trait)
    target = score + rng.normal(0.0, 0.1 * score.std() + 1e-6, size=n_samples)

    width = max(4, len(str(n_samples)))
    sample_ids = [f"{prefix}{i + 1:0{width}d}" for i in range(n_samples)]
    table = biom.Table(counts, observation_ids=world.names, sample_ids=sample_ids)
    rows = [(sid, f"env{envs[s]}", float(target[s])) for s, sid in enumerate(sample_ids)]
    return table, rows


def composition_score(counts: sparse.csc_matrix, tip_trait: np.ndarray) -> np.ndarray:
    """Each sample's abundance-weighted mean trait, from (ASVs x samples) counts."""
    score = np.empty(counts.shape[1])
    # C-ordered dense blocks of >= 4 samples: OpenBLAS's gemv takes samples four at a time (a lone 1-3
    # another path), so each sample is summed as over SIM_VERSION 2's whole dense matrix: bit-identical
    # scores. A sparse dot per sample differs in the last bit, which would change metadata.tsv.
    edges = [*range(0, max(counts.shape[1] - 3, 1), SCORE_BLOCK_SAMPLES), counts.shape[1]]
    for lo, hi in itertools.pairwise(edges):
        block = counts[:, lo:hi].toarray(order="C")
        score[lo:hi] = tip_trait @ (block / block.sum(0, keepdims=True))
    return score


def write_simulated(params: SimParams, directory: Path) -> None:
    """Write table.biom (HDF5), tree.nwk and metadata.tsv into `directory`."""
    table, tree, rows = simulate(params)
    with h5py.File(directory / FILES["table"], "w") as f:
        table.to_hdf5(f, generated_by="aamperf.data.simulate")
    tree.write(str(directory / FILES["tree"]), format="newick")
    lines = ["sample_id\tenvironment\ttarget"] + [f"{sid}\t{env}\t{y!r}" for sid, env, y in rows]
    (directory / FILES["metadata"]).write_text("\n".join(lines) + "\n")
    hashes = {name: sha256_of(directory / name) for name in FILES.values()}
    (directory / MANIFEST).write_text(json.dumps(hashes, indent=2) + "\n")
