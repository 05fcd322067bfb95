"""The sample store (`<data.cache_dir>/samples/`): its files verified when it is opened, a damaged one
rebuilt with a warning."""

import os

import pytest
from omegaconf import OmegaConf

from aamperf.config import DataConfig, DataloaderConfig
from aamperf.data import build_data

SIM = {"n_samples": 24, "n_asvs": 48, "mean_richness": 12, "depth": 1500, "rarefy_depth": 500, "max_asvs": 16}


def build(cache_dir):
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"cache_dir": str(cache_dir), **SIM})
    return build_data(cfg, batch_size=4, seed=0, loader=OmegaConf.structured(DataloaderConfig))


def items(data) -> list[dict]:
    return [{k: getattr(v, "tolist", lambda v=v: v)() for k, v in item.items()} for item in data.dataset]


@pytest.mark.parametrize("name", ["rows", "reads", "branches"])
def test_a_store_file_damaged_at_the_same_size_is_found_warned_and_rebuilt(tmp_path, caplog, name):
    first = build(tmp_path)
    (store,) = (tmp_path / "samples").iterdir()
    whole = (store / name).read_bytes()
    fd = os.open(store / name, os.O_WRONLY)  # in place, the length unchanged: the index still agrees
    os.pwrite(fd, bytes(b ^ 0x5A for b in whole[40:48]), 40)
    os.close(fd)
    assert (store / name).stat().st_size == len(whole) and (store / name).read_bytes() != whole
    again = build(tmp_path)
    assert not again.samples_cached  # found damaged: built again
    assert f"sample store {store} is damaged ({name}: its checksum differs from the index's)" in caplog.text
    assert (store / name).read_bytes() == whole
    assert items(again) == items(first)
    assert build(tmp_path).samples_cached  # the rebuilt store serves the next run
