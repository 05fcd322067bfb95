"""aamperf/report/runs.py: runs grouped into configurations by their overrides."""

from pathlib import Path

from aamperf.report.runs import Run, group_runs


def test_a_boolean_written_back_by_optunas_sweeper_is_the_same_configuration():
    # the search's reference run keeps the command line's `false`; Optuna's trials write `False`
    reference = Run(Path("reference"), ["optim=baseline", "metrics.rf_baseline=false"], {"seed": 0})
    trial = Run(Path("0_trial"), ["precision=bf16", "metrics.rf_baseline=False"], {"seed": 0})
    groups = group_runs([reference, trial])
    assert [g.config for g in groups] == ["optim=baseline", "precision=bf16"]
