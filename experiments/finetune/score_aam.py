"""The original AAM's fine-tuned regression applied to the held-out samples (heldout.py), in its own venv.

Its `aam predict` (jbk708/aam 6f65d20) cannot score these runs: it builds the model with its default layer
counts whatever the checkpoint's `attention_layers`, keeps a z-scored target in z units, and takes the
first ASVs of a sample past the token limit where `aam train --asv-sampling abundance` trained on the most
abundant. So this builds the model as `aam train` built it (cli/train.py: every stack `attention_layers`
deep, `attention_heads` wide, from the checkpoint's config; no count head, as `--no-count-prediction`),
loads `final_model.pt` (the weights after the last epoch, which its reported validation scored) strictly,
batches the samples with the original's own ASVDataset and collate_fn (abundance), and undoes the z-score
with the original's GlobalNormalizer fitted as `aam train` fits it: on the targets of its training samples
(`train_samples.txt`).
Usage: python score_aam.py RUN_DIR DATA_DIR  (RUN_DIR: the run's directory, its `aam/` the original's output)
Writes RUN_DIR/heldout_predictions.tsv: sample_id, predicted (the target's units), observed; exit 3 for a
classification or a model with categorical columns (not scored).
"""

import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from aam.data.biom_loader import BIOMLoader
from aam.data.dataset import ASVDataset, collate_fn
from aam.data.normalization import GlobalNormalizer
from aam.models.sequence_predictor import SequencePredictor
from torch.utils.data import DataLoader

NOT_A_REGRESSION = 3  # the exit code score_heldout.sh passes over
run, data = Path(sys.argv[1]), Path(sys.argv[2])
checkpoint = torch.load(run / "aam" / "final_model.pt", map_location="cpu", weights_only=True)
config = checkpoint["config"]
if config.get("is_classifier") or config.get("categorical_encoder"):
    print("score_aam.py: not scored: it scores a regression without categorical columns", file=sys.stderr)
    sys.exit(NOT_A_REGRESSION)
layers, heads = config["attention_layers"], config["attention_heads"]
stacks = ("asv", "sample", "encoder", "count", "target")
model = SequencePredictor(
    encoder_type=config["encoder_type"],
    vocab_size=7,
    embedding_dim=config["embedding_dim"],
    max_bp=config["max_bp"],
    token_limit=config["token_limit"],
    **{f"{stack}_num_layers": layers for stack in stacks},
    **{f"{stack}_num_heads": heads for stack in stacks},
    out_dim=config["out_dim"],
    is_classifier=False,
    predict_nucleotides=True,
    target_layer_norm=config["target_layer_norm"],
    bounded_targets=config["bounded_targets"],
    learnable_output_scale=config["learnable_output_scale"],
    output_activation=config["output_activation"],
    regressor_hidden_dims=config["regressor_hidden_dims"],
    regressor_dropout=config["regressor_dropout"],
    residual_regression_head=config["residual_regression_head"],
    count_prediction=False,
)
model.load_state_dict(checkpoint["model_state_dict"])  # strict: a model built otherwise is refused
model.eval()

metadata = pd.read_csv(data / "metadata.tsv", sep="\t").set_index("sample_id")
trained = (run / "aam" / "train_samples.txt").read_text().split()
normalizer = GlobalNormalizer(method="zscore").fit(metadata.loc[trained, "target"].to_numpy(dtype=float))

table = BIOMLoader().load_table(str(data / "heldout" / "table.biom"))
dataset = ASVDataset(table=table, metadata=None, max_bp=config["max_bp"], token_limit=config["token_limit"])
batches = DataLoader(
    dataset,
    batch_size=8,
    shuffle=False,
    collate_fn=partial(collate_fn, token_limit=config["token_limit"], asv_sampling="abundance"),
)
ids, predicted = [], []
with torch.no_grad():
    for batch in batches:
        out = model(batch["tokens"], return_nucleotides=False)["target_prediction"].reshape(-1)
        predicted += normalizer.denormalize(out).tolist()
        ids += batch["sample_ids"]
observed = pd.read_csv(data / "heldout" / "metadata.tsv", sep="\t").set_index("sample_id")["target"]
rows = pd.DataFrame({"sample_id": ids, "predicted": predicted, "observed": observed.loc[ids].to_numpy()})
rows.to_csv(run / "heldout_predictions.tsv", sep="\t", index=False)
print(f"{run / 'heldout_predictions.tsv'}: {len(rows)} samples")
