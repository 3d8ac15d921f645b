"""The tuning table answers every shape class the kernels can be launched with."""

import pytest

from kernels import lora_tuning


def test_small_batches_go_per_token_and_large_ones_by_segment():
    assert lora_tuning.choose_path(lora_tuning.SGMV_MIN_TOKENS - 1) == "bgmv"
    assert lora_tuning.choose_path(lora_tuning.SGMV_MIN_TOKENS) == "sgmv"


def test_tile_height_grows_with_the_metadata_capacity():
    assert lora_tuning.sgmv_block_m(lora_tuning.SGMV_LARGE_TOKENS - 1) == 16
    assert lora_tuning.sgmv_block_m(lora_tuning.SGMV_LARGE_TOKENS) == lora_tuning.SGMV_BLOCK_M


@pytest.mark.parametrize("max_tokens", [1, 300, 8192])
@pytest.mark.parametrize("path", ["bgmv", "sgmv"])
def test_every_rank_and_slice_count_has_a_config(path, max_tokens):
    block_m = lora_tuning.sgmv_block_m(max_tokens)
    for rank in (1, 8, 12, 16, 17, 32, 64, 128, 256):
        assert lora_tuning.expand_config(path, block_m, rank).block_n > 0
        for num_slices in (1, 2, 3):
            assert lora_tuning.shrink_config(path, block_m, rank, num_slices).block_k > 0


@pytest.mark.parametrize(("value", "want"), [("1", True), ("0", False), ("", lora_tuning.FOLD_EXPAND)])
def test_the_fold_switch_reads_the_environment(monkeypatch, value, want):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, value)
    assert lora_tuning.fold_expand() is want


def test_the_fold_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "yes")
    with pytest.raises(ValueError, match="LORASERVE_LORA_FOLD must be '1' or '0'"):
        lora_tuning.fold_expand()


def test_per_token_batches_tile_by_the_bgmv_group_and_others_by_the_sgmv_height():
    assert lora_tuning.tile_rows(1) == lora_tuning.tile_rows(lora_tuning.SGMV_MIN_TOKENS - 1) == lora_tuning.BGMV_GROUP
    for num_tokens in (lora_tuning.SGMV_MIN_TOKENS, lora_tuning.SGMV_LARGE_TOKENS):
        assert lora_tuning.tile_rows(num_tokens) == lora_tuning.sgmv_block_m(num_tokens)


def test_every_per_token_config_runs_on_per_token_metadata():
    """A BGMV config's group is 1 (any metadata) or the tile height `tile_rows` gives per-token batches."""
    configs = [*lora_tuning._SHRINK.items(), *lora_tuning._EXPAND.items()]
    assert {cfg.group for key, cfg in configs if key[0] == "bgmv"} <= {1, lora_tuning.BGMV_GROUP}


def test_the_group_override_tiles_per_token_batches_and_groups_their_configs(monkeypatch):
    monkeypatch.setenv(lora_tuning.BGMV_GROUP_ENV, "4")
    assert lora_tuning.tile_rows(64) == 4
    assert lora_tuning.tile_rows(lora_tuning.SGMV_MIN_TOKENS) == lora_tuning.sgmv_block_m(lora_tuning.SGMV_MIN_TOKENS)
    shrink = lora_tuning.shrink_config("bgmv", 4, 16, 3)
    assert shrink == lora_tuning.grouped(lora_tuning.table_shrink_config("bgmv", 4, 16, 3), 4)
    assert shrink.group == lora_tuning.expand_config("bgmv", 4, 16).group == 4
    assert lora_tuning.shrink_config("sgmv", 16, 16, 3) == lora_tuning.table_shrink_config("sgmv", 16, 16, 3)


def test_the_group_override_refuses_other_values(monkeypatch):
    monkeypatch.setenv(lora_tuning.BGMV_GROUP_ENV, "3")
    with pytest.raises(ValueError, match="LORASERVE_LORA_GROUP must be one of 1, 2, 4, 8, 16"):
        lora_tuning.bgmv_group()
