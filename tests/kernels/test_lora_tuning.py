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


def test_the_per_token_path_folds_into_every_fused_op(monkeypatch):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)
    assert lora_tuning.folded_ops("bgmv") == {"rotary_and_write_kv", "silu_and_mul", "add_rms_norm"}


def test_the_segment_path_folds_into_every_fused_op_but_the_norm(monkeypatch):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)
    assert lora_tuning.folded_ops("sgmv") == {"rotary_and_write_kv", "silu_and_mul"}


def test_no_op_folds_when_the_fold_is_off(monkeypatch):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "0")
    assert lora_tuning.folded_ops("bgmv") == lora_tuning.folded_ops("sgmv") == frozenset()


@pytest.fixture
def segments_on(monkeypatch):
    monkeypatch.delenv(lora_tuning.DECODE_SEGMENTS_ENV, raising=False)


@pytest.mark.parametrize(("tokens", "rank", "path"), [
    (32, 64, "sgmv"), (127, 64, "sgmv"), (32, 33, "sgmv"), (32, 128, "sgmv"), (31, 64, "bgmv"),
    (64, 32, "sgmv"), (64, 17, "sgmv"), (127, 32, "sgmv"), (63, 32, "bgmv"), (32, 32, "bgmv"),
    (64, 16, "bgmv"), (128, 16, "bgmv"), (64, 8, "bgmv"),
])
def test_rows_on_one_adapter_run_in_segments_from_32_tokens_at_rank_64_and_64_tokens_at_rank_32(
        segments_on, tokens, rank, path):
    """Rank 16 and less stays per token below SGMV_MIN_TOKENS."""
    assert lora_tuning.step_path(tokens, rank, [3] * tokens) == path


@pytest.mark.parametrize(("tokens", "rank", "path"), [
    (80, 64, "sgmv"), (128, 64, "sgmv"), (80, 32, "sgmv"), (80, 17, "sgmv"), (79, 64, "bgmv"), (64, 32, "bgmv"),
    (128, 16, "bgmv"),
])
def test_rows_spread_over_many_adapters_run_in_segments_from_80_tokens_at_rank_32_and_more(
        segments_on, tokens, rank, path):
    """Over 64 adapters: 1 or 2 rows per adapter."""
    assert lora_tuning.step_path(tokens, rank, [t % 64 for t in range(tokens)]) == path


@pytest.mark.parametrize(("adapters", "path"), [(1, "sgmv"), (8, "sgmv"), (9, "bgmv"), (64, "bgmv")])
def test_few_adapters_are_8_rows_per_adapter_or_more(segments_on, adapters, path):
    assert lora_tuning.step_path(64, 64, [t % adapters for t in range(64)]) == path


def test_a_step_of_base_rows_only_stays_per_token(segments_on):
    assert lora_tuning.step_path(64, 64, [-1] * 64) == "bgmv"


def test_steps_of_the_segment_path_by_size_keep_it_whatever_their_rank_and_adapters(segments_on):
    tokens = lora_tuning.SGMV_MIN_TOKENS
    assert lora_tuning.step_path(tokens, 64, list(range(tokens))) == "sgmv"
    assert lora_tuning.step_path(tokens, 16, [0] * tokens) == "sgmv"


def test_the_decode_segments_switch_keeps_smaller_steps_per_token(monkeypatch):
    monkeypatch.setenv(lora_tuning.DECODE_SEGMENTS_ENV, "0")
    assert lora_tuning.step_path(64, 64, [0] * 64) == "bgmv"
    assert lora_tuning.step_path(96, 64, list(range(96))) == "bgmv"
    assert lora_tuning.step_path(lora_tuning.SGMV_MIN_TOKENS, 64, [0] * lora_tuning.SGMV_MIN_TOKENS) == "sgmv"


def test_the_decode_segments_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(lora_tuning.DECODE_SEGMENTS_ENV, "on")
    with pytest.raises(ValueError, match="LORASERVE_LORA_DECODE_SEGMENTS must be '1' or '0'"):
        lora_tuning.path_for(64, 64, shared=True)


@pytest.fixture
def tiles_on(monkeypatch):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)
    monkeypatch.delenv(lora_tuning.DECODE_TILES_ENV, raising=False)


TILED = frozenset({"silu_and_mul"})


@pytest.mark.parametrize(("tokens", "adapters", "tiled"), [
    (32, 1, True), (32, 4, True), (32, 16, False), (32, 64, False),
    (64, 1, True), (64, 4, True), (64, 8, True), (64, 16, False),
    (128, 16, True), (128, 17, False), (128, 64, False),
    (16, 1, False), (31, 1, False),
])
def test_silu_and_mul_tiles_from_32_tokens_with_8_rows_per_adapter(tiles_on, tokens, adapters, tiled):
    slots = [t % adapters for t in range(tokens)]
    assert lora_tuning.tiled_decode_ops(tokens, slots) == (TILED if tiled else frozenset())


def test_base_rows_do_not_count_towards_the_rows_per_adapter(tiles_on):
    """64 rows, 8 of them on each of 4 adapters (32 base): still 8 per adapter; one adapter row fewer is not."""
    slots = [t % 4 if t < 32 else -1 for t in range(64)]
    assert lora_tuning.tiled_decode_ops(64, slots) == TILED
    assert lora_tuning.tiled_decode_ops(64, slots[1:] + [-1]) == frozenset()


def test_a_step_without_adapter_rows_tiles_nothing(tiles_on):
    assert lora_tuning.tiled_decode_ops(64, [-1] * 64) == frozenset()


def test_steps_of_the_segment_path_are_left_to_the_path(tiles_on):
    """From SGMV_MIN_TOKENS every fold is tiled anyway (`fused_triton._tiled`): nothing to choose."""
    tokens = lora_tuning.SGMV_MIN_TOKENS
    assert lora_tuning.tileable_decode_ops(tokens) == frozenset()
    assert lora_tuning.tiled_decode_ops(tokens, [0] * tokens) == frozenset()


def test_only_steps_of_32_to_128_tokens_can_tile(tiles_on):
    assert [t for t in range(1, 300) if lora_tuning.tileable_decode_ops(t)] == list(range(32, 129))


@pytest.mark.parametrize("env", [lora_tuning.DECODE_TILES_ENV, lora_tuning.FOLD_EXPAND_ENV])
def test_nothing_tiles_when_the_switch_or_the_fold_is_off(monkeypatch, env):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)
    monkeypatch.delenv(lora_tuning.DECODE_TILES_ENV, raising=False)
    monkeypatch.setenv(env, "0")
    assert lora_tuning.tileable_decode_ops(64) == frozenset()
    assert lora_tuning.tiled_decode_ops(64, [0] * 64) == frozenset()


@pytest.mark.parametrize(("value", "want"), [("1", True), ("0", False), ("", lora_tuning.DECODE_TILES)])
def test_the_decode_tiles_switch_reads_the_environment(monkeypatch, value, want):
    monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, value)
    assert lora_tuning.decode_tiles() is want


def test_the_decode_tiles_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "on")
    with pytest.raises(ValueError, match="LORASERVE_LORA_DECODE_TILES must be '1' or '0'"):
        lora_tuning.decode_tiles()
