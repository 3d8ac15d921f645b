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


@pytest.mark.parametrize(("tokens", "want"), [
    (1, {"rotary_and_write_kv", "silu_and_mul", "add_rms_norm"}),
    (lora_tuning.SGMV_MIN_TOKENS - 1, {"rotary_and_write_kv", "silu_and_mul", "add_rms_norm"}),
    (lora_tuning.SGMV_MIN_TOKENS, {"rotary_and_write_kv", "silu_and_mul"}),
])
def test_the_segment_path_folds_into_every_fused_op_but_the_norm(monkeypatch, tokens, want):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)
    assert lora_tuning.folded_ops(tokens) == want


def test_no_op_folds_when_the_fold_is_off(monkeypatch):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "0")
    assert lora_tuning.folded_ops(1) == lora_tuning.folded_ops(8192) == frozenset()


def test_the_fold_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "yes")
    with pytest.raises(ValueError, match="LORASERVE_LORA_FOLD must be '1' or '0'"):
        lora_tuning.fold_expand()
