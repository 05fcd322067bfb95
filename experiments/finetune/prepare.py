"""The data both programs fine-tune on: experiments/original/prepare.py's table and UniFrac, plus metadata.

experiments/original/prepare.py writes the rarefied table.biom and its unifrac.npy (+ .ids.txt) from
aamperf's simulated data set; this adds that data set's metadata.tsv (sample_id, environment, target:
aamperf/data/simulate.py), limited to the table's samples, in the table's order, and a column
`environment_id`: the environment's index among the sorted names (env0 -> 0), because the original's
`aam train --classifier` reads its target column with float() and takes the number as the class. Both
programs read the file: the original needs a `sample_id` column, aamperf takes the first column as the id.
Usage: python prepare.py OUT_DIR N_SAMPLES N_ASVS MEAN_RICHNESS RAREFY_DEPTH [SIM_DEPTH]
"""

import runpy
import sys
from pathlib import Path

from aamperf.data.simulate import SimParams, ensure_simulated

out = Path(sys.argv[1])
runpy.run_path("experiments/original/prepare.py", run_name="__main__")  # reads the same sys.argv
n_samples, n_asvs, richness = map(int, sys.argv[2:5])
sim_depth = int(sys.argv[6]) if len(sys.argv) > 6 else 5000
params = SimParams(n_samples, n_asvs, 4, richness, sim_depth, 0)  # experiments/original/prepare.py's
files = ensure_simulated(params, Path.home() / ".cache/aamperf")
header, *rows = files["metadata"].read_text().splitlines()
by_id = {row.split("\t", 1)[0]: row for row in rows}
kept = [by_id[sample_id].split("\t") for sample_id in (out / "unifrac.ids.txt").read_text().split()]
classes = sorted({row[1] for row in kept})  # aamperf's classes: the training samples', sorted
lines = [header + "\tenvironment_id"] + ["\t".join([*row, str(classes.index(row[1]))]) for row in kept]
(out / "metadata.tsv").write_text("\n".join(lines) + "\n")
print(f"{out / 'metadata.tsv'}: {len(kept)} samples, {lines[0]!r}; environments {', '.join(classes)}")
