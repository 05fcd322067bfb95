"""Samples no fine-tune trained or validated on, to score both programs' models on (run.sh, HELDOUT=N).

A validation split of 16 samples scores a model with a wide margin: most of the spread between paired seeds
is which 16 samples they were. These are N more samples of the same simulated data set
(`aamperf.data.simulate.simulate_heldout`: its tree, sequences, environments and target, new draws), rarefied
as experiments/original/prepare.py rarefies the data set (`rarefy`, seed 0), written to OUT_DIR/heldout/ as
`table.biom` (the ASVs they hold) and `metadata.tsv` (the columns of prepare.py's, `environment_id` by the
data set's sorted environments).
Usage: python heldout.py OUT_DIR N_HELDOUT N_SAMPLES N_ASVS MEAN_RICHNESS RAREFY_DEPTH [SIM_DEPTH]
"""

import runpy
import sys
from pathlib import Path

from aamperf.data.simulate import SimParams, simulate_heldout

HELDOUT_SEED = 1  # the held-out draws' generator: [data set seed, this]

out = Path(sys.argv[1])
n_heldout, n_samples, n_asvs, richness, depth = map(int, sys.argv[2:7])
sim_depth = int(sys.argv[7]) if len(sys.argv) > 7 else 5000
rarefy = runpy.run_path("experiments/original/prepare.py")["rarefy"]
params = SimParams(n_samples, n_asvs, 4, richness, sim_depth, 0)  # prepare.py's data set
table, rows = simulate_heldout(params, n_heldout, HELDOUT_SEED)
table = rarefy(table, depth, seed=0)
table = table.filter(lambda values, _id, _md: values.sum() > 0, axis="observation", inplace=False)
header, *data_rows = (out / "metadata.tsv").read_text().splitlines()
classes = sorted({line.split("\t")[1] for line in data_rows})
kept = {sample_id: (env, target) for sample_id, env, target in rows}
lines = [header] + [
    f"{sid}\t{kept[sid][0]}\t{kept[sid][1]!r}\t{classes.index(kept[sid][0])}" for sid in table.ids()
]
(out / "heldout").mkdir(exist_ok=True)
with open(out / "heldout" / "table.biom", "w") as f:
    table.to_json("experiments/finetune/heldout.py", direct_io=f)
(out / "heldout" / "metadata.tsv").write_text("\n".join(lines) + "\n")
print(f"{out / 'heldout'}: {table.shape[1]} held-out samples x {table.shape[0]} ASVs at {depth} reads")
