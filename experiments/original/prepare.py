"""Write one data set both programs read identically: a rarefied BIOM table and its UniFrac matrix.

aamperf's simulator writes the table and tree; the table is rarefied here once (seed 0), so each
program's own rarefaction at the same depth changes nothing, and the matrix (scikit-bio unweighted
UniFrac, as aamperf computes it) is saved as .npy in the table's sample order with <name>.ids.txt.
Usage: python prepare.py OUT_DIR N_SAMPLES N_ASVS MEAN_RICHNESS RAREFY_DEPTH [SIM_DEPTH]
(SIM_DEPTH: reads per simulated sample before rarefaction, default 5000)
"""

import sys
from pathlib import Path

import biom
import numpy as np

from aamperf.data.samples import rarefy_sample
from aamperf.data.simulate import SimParams, ensure_simulated
from aamperf.data.tables import read_table
from aamperf.data.trees import read_tree
from aamperf.data.unifrac import compute_unifrac


def rarefy(table: biom.Table, depth: int, seed: int) -> biom.Table:
    """Each sample drawn down to `depth` reads as aamperf draws it (rarefy_sample); shallower ones dropped."""
    columns, ids = [], []
    for values, sample_id, _ in table.iter(axis="sample", dense=True):
        drawn = rarefy_sample(values[values > 0], depth, seed, sample_id)
        if drawn is not None:
            column = np.zeros_like(values, dtype=np.int64)
            column[values > 0] = drawn
            columns.append(column)
            ids.append(sample_id)
    return biom.Table(np.stack(columns, axis=1), table.ids(axis="observation"), ids)


def main() -> None:
    out = Path(sys.argv[1])
    n_samples, n_asvs, richness, depth = map(int, sys.argv[2:6])
    sim_depth = int(sys.argv[6]) if len(sys.argv) > 6 else 5000
    params = SimParams(n_samples, n_asvs, 4, richness, sim_depth, 0)
    files = ensure_simulated(params, Path.home() / ".cache/aamperf")
    table = rarefy(read_table(files["table"]), depth, seed=0)
    table = table.filter(lambda values, _id, _md: values.sum() > 0, axis="observation", inplace=False)
    matrix = compute_unifrac(table, read_tree(files["tree"]))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.biom", "w") as f:
        table.to_json("experiments/original/prepare.py", direct_io=f)
    np.save(out / "unifrac.npy", matrix)
    (out / "unifrac.ids.txt").write_text("\n".join(table.ids()) + "\n")
    richness = (table.matrix_data > 0).sum(axis=0).A1
    print(
        f"{out}: {table.shape[1]} samples x {table.shape[0]} ASVs at {depth} reads; "
        f"ASVs per sample median {int(np.median(richness))}, min {richness.min()}, max {richness.max()}"
    )


if __name__ == "__main__":
    main()
