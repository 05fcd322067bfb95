"""Write one data set both programs read identically: a rarefied BIOM table and its UniFrac matrix.

aamperf's simulator writes the table and tree; the table is rarefied here once (seed 0), so each
program's own rarefaction at the same depth changes nothing, and the matrix (scikit-bio unweighted
UniFrac, as aamperf computes it) is saved as .npy in the table's sample order with <name>.ids.txt.
Usage: python prepare.py OUT_DIR N_SAMPLES N_ASVS MEAN_RICHNESS RAREFY_DEPTH
"""

import sys
from pathlib import Path

import numpy as np

from aamperf.data.simulate import SimParams, ensure_simulated
from aamperf.data.tables import rarefy, read_table, read_tree
from aamperf.data.unifrac import compute_unifrac

out = Path(sys.argv[1])
n_samples, n_asvs, richness, depth = map(int, sys.argv[2:6])
files = ensure_simulated(SimParams(n_samples, n_asvs, 4, richness, 5000, 0), Path.home() / ".cache/aamperf")
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
