"""Every problem of `data.*` that the config and the file system decide, found up front and each naming its
fix (the files are read by tables.py)."""

from omegaconf import DictConfig

from aamperf.data.tables import BIOM_FILES, existing_file, read_val_samples, unifrac_ids_file
from aamperf.errors import UserError

SIMULATED_SIZES = ("n_samples", "n_asvs", "n_envs", "mean_richness", "depth")  # data.* of data=simulated


def check_data(cfg: DictConfig) -> list[str]:
    """Every problem of `data.*` that the config and the file system decide (the files are there and
    can be opened; none is read but data.val_samples' short list of ids), each naming its fix. What
    needs the data's content is found as build_data reads it."""
    d, problems = cfg.data, []
    if not 0 < d.val_fraction < 1:
        problems.append(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (e.g. 0.2)")
    if d.get("val_samples") is not None:
        try:
            read_val_samples(d.val_samples)
        except UserError as exc:
            problems.append(str(exc))
    if d.rarefy_depth < 1:
        problems.append(f"data.rarefy_depth={d.rarefy_depth} must be >= 1 (the reads kept per sample)")
    problems += check_normalize_by(d) + check_weight_by(cfg)
    if d.unifrac_metric != "unweighted" and d.unifrac_mode == "batch":
        problems.append(
            f"data.unifrac_metric={d.unifrac_metric} is computed up front: set data.unifrac_mode=precomputed "
            "(or null; batch computes unweighted UniFrac only)"
        )
    if d.unifrac_metric != "unweighted" and d.get("unifrac") is not None:
        problems.append(
            f"data.unifrac_metric={d.unifrac_metric} is of UniFrac computed from data.tree; data.unifrac's "
            "matrix is read as it is: leave data.unifrac_metric=unweighted"
        )
    return problems + (check_simulated(cfg) if d.source == "simulated" else check_biom(d))


def check_normalize_by(d: DictConfig) -> list[str]:
    """data.normalize_by goes with data.target_transform=zscore_category, both ways, and is not the target."""
    columns = list(d.get("normalize_by") or [])
    if d.target_transform == "zscore_category" and not columns:
        return [
            "data.target_transform=zscore_category z-scores the target within each category of metadata "
            "columns: name them, data.normalize_by=[<column>,...]"
        ]
    if columns and d.target_transform != "zscore_category":
        return [
            f"data.normalize_by={columns} is read by data.target_transform=zscore_category only (it is "
            f"{d.target_transform}); set that, or data.normalize_by=[]"
        ]
    if d.target is not None and d.target in columns:
        return [f"data.normalize_by: {d.target!r} is data.target itself; name other metadata columns"]
    return []


def check_weight_by(cfg: DictConfig) -> list[str]:
    """data.weight_by goes with loss.category_weights, both ways, and is not the target."""
    d, columns = cfg.data, list(cfg.data.get("weight_by") or [])
    weights = cfg.loss.get("category_weights") if "loss" in cfg else None
    if weights is not None and not columns:
        return [
            "loss.category_weights weighs each sample by its category of metadata columns: name them, "
            "data.weight_by=[<column>,...]"
        ]
    if columns and weights is None:
        return [
            f"data.weight_by={columns} is read by loss.category_weights (it is null): set "
            "loss.category_weights=balanced (or a category -> weight mapping), or data.weight_by=[]"
        ]
    if columns and d.target is None:
        return [f"data.weight_by={columns} weighs the target part, and data.target is null: set data.target"]
    if d.target is not None and d.target in columns:
        return [f"data.weight_by: {d.target!r} is data.target itself; name other metadata columns"]
    return []


def check_simulated(cfg: DictConfig) -> list[str]:
    """No user file, sizes >= 1, and enough samples for a validation batch and a training batch
    (rarefaction may drop a few more as the run starts; data.val_samples' are counted then)."""
    d, t = cfg.data, cfg.trainer
    ignored = [name for name in BIOM_FILES if d[name] is not None]
    problems = [f"data.{name} is set but data.source=simulated ignores it; add data=biom" for name in ignored]
    problems += [f"data.{name}={d[name]} must be >= 1" for name in SIMULATED_SIZES if d[name] < 1]
    if problems or not 0 < d.val_fraction < 1 or d.get("val_samples") is not None:
        return problems
    n_val = round(d.n_samples * d.val_fraction)
    if n_val < 2:
        problems.append(
            f"data.n_samples={d.n_samples} x data.val_fraction={d.val_fraction} leaves {n_val} validation "
            "samples (UniFrac needs >= 2 per batch); raise data.val_fraction"
        )
    fixed = isinstance(t.batch_size, int) and not isinstance(t.batch_size, bool) and t.grad_accum_steps >= 1
    batch = t.batch_size // t.grad_accum_steps if fixed else 2  # trainer.batch_size=auto: 2 at least
    if d.n_samples - n_val < batch:
        problems.append(
            f"data.n_samples={d.n_samples} leaves at most {d.n_samples - n_val} training samples after "
            f"data.val_fraction={d.val_fraction}, fewer than a batch of {batch} (trainer.batch_size / "
            "grad_accum_steps); raise data.n_samples, or lower trainer.batch_size or data.val_fraction"
        )
    return problems


def check_biom(d: DictConfig) -> list[str]:
    """A table, exactly one of tree / unifrac, metadata for a target, and each file given there to
    open (a .npy matrix with its ids beside it)."""
    problems = [] if d.table is not None else ["data.source=biom needs data.table=<file.biom>"]
    if (d.tree is None) == (d.unifrac is None):
        problems.append(
            "data=biom needs exactly one of data.tree=<tree.nwk> (UniFrac computed from it) "
            "or data.unifrac=<matrix> (precomputed)"
        )
    if d.unifrac_mode == "batch" and d.tree is None:
        problems.append(
            "data.unifrac_mode=batch computes UniFrac from data.tree; give data.tree=<tree.nwk>, or "
            "data.unifrac_mode=precomputed to use data.unifrac's matrix"
        )
    if d.target is not None and d.metadata is None:
        problems.append(f"data.target={d.target} needs data.metadata=<samples.tsv>")
    for name in [name for name in BIOM_FILES if d[name] is not None]:
        try:
            path = existing_file(d[name], f"data.{name}")
            if name == "unifrac":
                unifrac_ids_file(path)
        except UserError as exc:
            problems.append(str(exc))
    return problems
