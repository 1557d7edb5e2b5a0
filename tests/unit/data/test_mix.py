"""Weighted mixtures (data/mix.py) and resampled shards: the draws follow the weights (a chi-square test against the
multinomial they define) and depend on (seed, reader, index) alone; each sample comes from the source drawn for its
index, named by its shard; a restored 3-source mixture continues as the uninterrupted one does; resampled passes draw
shards with replacement from all of them; and every refusal. (Launched runs: tests/launched/test_mixture_runs.py.)"""

import math
import random
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from disco_clip_ds.data.mix import Mixture, MixtureStream, cumulative_weights, draw_source, upsampling_weights
from disco_clip_ds.data.shards import resampled_order
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.streams.state import write_stream_state
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.train.args import DataArguments
from disco_clip_ds.train.validate.data import check_mixture

WEIGHTS = (0.6, 0.3, 0.1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three sources of 4, 2 and 2 shards x 3 samples, one corrupt sample in the first."""
    root = tmp_path_factory.mktemp("mix")
    return [
        write_shards(root / "a", 4, 3, seed=1, bad={4: "corrupt"}),
        write_shards(root / "b", 2, 3, seed=2),
        write_shards(root / "c", 2, 3, seed=3),
    ]


def _mixture(sources, weights=WEIGHTS) -> Mixture:
    return Mixture(tuple(map(tuple, sources)), ("a", "b", "c"), tuple(weights))


def _stream(sources, weights=WEIGHTS, **options) -> MixtureStream:
    options = {"rank": 0, "world_size": 2, "seed": 3, "shuffle_buffer": 2, **options}
    return MixtureStream(_mixture(sources, weights), 16, sample_ids=True, **options)


def _source_of(item) -> str:
    """The source folder of a sample, from the shard it was read from (sample_ids), not from the mixture's state."""
    return Path(item[2][0]).parent.name


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_draws_follow_the_weights():
    n, cumulative = 30_000, cumulative_weights(WEIGHTS)
    counts = [0, 0, 0]
    for index in range(n):
        counts[draw_source(7, 0, index, cumulative)] += 1
    # the multinomial of n draws with these probabilities; a fixed seed: the test is deterministic
    assert chisquare(counts, [w * n for w in WEIGHTS]).pvalue > 1e-3, counts
    assert all(abs(c / n - w) < 0.01 for c, w in zip(counts, WEIGHTS)), counts


def test_a_draw_is_a_function_of_seed_reader_and_index_alone():
    cumulative = cumulative_weights(WEIGHTS)
    indices = list(range(500))
    forward = [draw_source(1, 2, i, cumulative) for i in indices]
    random.Random(0).shuffle(indices)  # drawn in another order: no state carried from one draw to the next
    assert [draw_source(1, 2, i, cumulative) for i in sorted(indices)] == forward
    assert forward != [draw_source(2, 2, i, cumulative) for i in range(500)]  # another seed, other draws
    assert forward != [draw_source(1, 3, i, cumulative) for i in range(500)]  # another reader, other draws


def test_each_sample_comes_from_the_source_drawn_for_its_index(sources):
    items = list(islice(_stream(sources), 60))
    cumulative = cumulative_weights(_mixture(sources).weights)
    assert [_source_of(item) for item in items] == ["abc"[draw_source(3, 0, i, cumulative)] for i in range(60)]
    rows = [item[3].tolist() for item in items]
    assert [row[1] for row in rows] == list(range(1, 61))  # the reader's count is its draw counter
    # each row's per-source counts are the samples drawn from that source so far
    seen = [sum(_source_of(item) == s for item in items) for s in "abc"]
    assert [rows[-1][3 + 5 * s] for s in range(3)] == seen


def test_a_one_source_view_reads_what_that_source_alone_reads(sources):
    """A mixture's source is read as its own stream: the samples it draws from source b are those a ShardStream of
    b alone yields, in its order."""
    items = list(islice(_stream(sources), 80))
    from_b = [item[1] for item in items if _source_of(item) == "b"]
    alone = ShardStream(sources[1], 16, rank=0, world_size=2, seed=3, shuffle_buffer=2, sample_ids=True)
    assert from_b == [item[1] for item in islice(alone, len(from_b))] and len(from_b) > 10


@pytest.mark.parametrize("resampled", [False, True])
def test_a_restored_three_source_mixture_continues_the_uninterrupted_one(sources, resampled):
    reference = list(islice(_stream(sources, resampled=resampled), 50))
    want = [(item[1], item[2], item[3].tolist()) for item in reference]
    for n in (1, 2, 9, 23, 40):
        position = reference[n - 1][3].tolist()
        stream = _stream(sources, resampled=resampled)
        stream.restore({0: position[1:]}, consumed_batches=0)
        resumed = list(islice(stream, 10))
        assert [(item[1], item[2], item[3].tolist()) for item in resumed] == want[n : n + 10], n
        assert stream.decoded.value == 10  # sought, not replayed


def test_resampled_passes_draw_shards_with_replacement_from_all_of_them():
    urls = [f"s{i}.tar" for i in range(8)]
    passes = [resampled_order(urls, 0, epoch, reader=1) for epoch in range(20)]
    assert all(len(order) == 8 for order in passes)
    assert sum(len(set(order)) < 8 for order in passes) >= 15  # repeats within a pass: with replacement
    assert {u for order in passes for u in order} == set(urls)  # a reader draws from every shard, not its share
    assert passes[0] != resampled_order(urls, 0, 0, reader=0)  # each reader its own draws


def test_a_resampled_stream_reads_shards_outside_its_share(tmp_path):
    urls = write_shards(tmp_path, 4, 2, seed=5)
    stream = ShardStream(urls, 16, rank=0, world_size=2, seed=0, shuffle_buffer=1, sample_ids=True, resampled=True)
    read = [item[2][0] for item in islice(stream, 80)]  # 10 passes of 4 drawn shards
    assert set(read) == set(urls)  # plain reader 0 of 2 would read urls[0::2] only
    assert max(read.count(u) for u in urls) > 20  # some shard drawn more often than a pass over all gives


def test_a_resume_with_other_weights_or_sources_is_refused_in_one_line(sources, tmp_path):
    stream = _stream(sources)
    rows = next(iter(stream))[3][None]
    write_stream_state(tmp_path, rows, stream.state_facts(), stream.state_fields)
    import json

    state = json.loads((tmp_path / "stream_state.json").read_text())
    assert state["sources"] == ["a", "b", "c"] and state["weights"] == pytest.approx(list(WEIGHTS))
    assert stream.positions_from(state, tmp_path) == {0: tuple(rows[0, 1:].tolist())}
    with pytest.raises(UsageError, match=r"weights \[0\.6, 0\.3, 0\.1\] -> \[0\.5, 0\.3, 0\.2\]") as error:
        _stream(sources, (0.5, 0.3, 0.2)).positions_from(state, tmp_path)
    assert "\n" not in str(error.value)
    other = MixtureStream(Mixture(tuple(map(tuple, sources)), ("a", "b", "d"), WEIGHTS), 16, world_size=2, seed=3)
    with pytest.raises(UsageError, match=r"sources \['a', 'b', 'c'\] -> \['a', 'b', 'd'\]"):
        other.positions_from({**state, "shuffle_buffer": other.block}, tmp_path)


def test_open_clips_upsampling_factors_weigh_each_shard():
    # open_clip: each shard weighted by its source's factor; 4 shards x 1 and 1 shard x 2 -> 4 : 2
    assert Mixture((("x",), ("y",)), ("a", "b"), tuple(upsampling_weights([1, 2], [4, 1]))).weights == (2 / 3, 1 / 3)
    assert Mixture((("x",), ("y",)), ("a", "b"), (3.0, 1.0)).weights == (0.75, 0.25)


def _args(workers: int = 1):
    accelerator = SimpleNamespace(dispatch_batches=False)
    return SimpleNamespace(world_size=2, dataloader_num_workers=workers, accelerator_config=accelerator)


def test_check_mixture_resolves_weights_and_open_clip_factors(sources):
    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    mixture = check_mixture(DataArguments(train_shards=spec, train_data_weights=[6, 3, 1]), _args())
    assert mixture.weights == pytest.approx(WEIGHTS) and mixture.names == ("a", "b", "c")
    assert [len(s) for s in mixture.sources] == [4, 2, 2]
    factors = check_mixture(DataArguments(train_shards=spec, train_data_upsampling_factors=["1::2", "2"]), _args())
    assert factors.weights == pytest.approx([4 / 12, 4 / 12, 4 / 12])  # 4 x 1, 2 x 2, 2 x 2 shards x factor
    assert check_mixture(DataArguments(train_shards=spec), _args()) is None  # no weights: concatenated


@pytest.mark.parametrize(
    "given, message",
    [
        ({"train_data_weights": [1, 2, 3], "train_data_upsampling_factors": ["1::2::3"]}, "not both"),
        ({"train_data_weights": [1, 2]}, "2 data weight(s) for 3 '::'-joined --train_shards sources"),
        ({"train_data_weights": [1, 0, 1]}, "each must be a positive finite number"),
        ({"train_data_weights": [1, float("inf"), 1]}, "each must be a positive finite number"),
        ({"train_data_weights": [1, -1, 1]}, "each must be a positive finite number"),
        ({"train_data_upsampling_factors": ["1::x::1"]}, "give numbers, one per source"),
        ({"train_data_weights": [1, 1, 1], "one_source": True}, "is one source: join the sources to mix with '::'"),
        ({"train_data_weights": [1, 1, 1], "dataset_name": "x"}, "a `datasets` source is one dataset"),
        ({"dataset_resampled": True, "dataset_name": "x"}, "--dataset_resampled draws webdataset shards"),
        ({"train_data_weights": [1, 1, 1], "workers": 2}, "source 1 (b): 2 shard(s) for 4 readers"),
    ],
)
def test_check_mixture_refusals_are_one_line(sources, given, message):
    given = dict(given)
    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    if given.pop("one_source", False):
        spec = str(Path(sources[0][0]).parent)
    if given.get("dataset_name"):
        spec = None
    workers = given.pop("workers", 1)
    with pytest.raises(UsageError) as error:
        check_mixture(DataArguments(train_shards=spec, **given), _args(workers))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_huge_weights_and_factors_are_normalised_without_overflow(sources):
    """1e308 1e308 overflows a plain sum (an OverflowError from math.fsum), and factor 1e308 x 4 shards is inf (the
    weights became nan, 0: every sample from the second source): the shares are those of the ratios, by hand."""
    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    huge = check_mixture(DataArguments(train_shards=spec, train_data_weights=[1e308, 1e308, 1e308]), _args())
    assert huge.weights == pytest.approx([1 / 3, 1 / 3, 1 / 3], rel=1e-15)
    factors = DataArguments(train_shards=spec, train_data_upsampling_factors=["1e308::1e308::5e307"])
    # 4, 2 and 2 shards x factors 1, 1, 1/2 (after scaling by the largest): 4 : 2 : 1
    assert check_mixture(factors, _args()).weights == pytest.approx([4 / 7, 2 / 7, 1 / 7], rel=1e-15)
    assert Mixture((("x",), ("y",)), ("a", "b"), (1e308, 1e308)).weights == (0.5, 0.5)


@pytest.mark.parametrize(
    "given, message",
    [
        ({"train_data_weights": [1e308, 1e-308, 1]}, "source 1's share underflows to 0"),
        ({"train_data_upsampling_factors": ["1e308::1e-308::1"]}, "source 1's share underflows to 0"),
        ({"train_data_upsampling_factors": ["1e400::1::1"]}, "data weights inf 1 1: each must be a positive finite"),
        ({"train_data_weights": [float("nan"), 1, 1]}, "data weights nan 1 1: each must be a positive finite"),
    ],
)
def test_weights_whose_shares_are_not_finite_and_positive_are_refused(sources, given, message):
    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    with pytest.raises(UsageError) as error:
        check_mixture(DataArguments(train_shards=spec, **given), _args())
    assert message in str(error.value) and "\n" not in str(error.value)


_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # nan, inf, -0.0, subnormals, 1.8e308 ...
    st.sampled_from([0.0, -1.0, 1e308, 1.7976931348623157e308, 5e-324, 1e-308, 1.0]),
    st.integers(min_value=-(10**400), max_value=10**400),  # beyond what a float holds
)
_WORDS = st.one_of(
    st.text(max_size=12),  # empty, whitespace, '::', any Unicode
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=4),  # non-UTF-8 argv
    st.sampled_from(["1e400", "-1e400", "nan", "inf", "1e-400", "1_0", "0x10", "../etc/passwd", "1::", "::", " "]),
    _NUMBERS.map(repr),
)


def _only_a_mixture_or_one_line(spec: str, **given) -> None:
    """The property: a Mixture whose shares are positive, finite and sum to 1 (None for no weights), or one
    UsageError line."""
    try:
        mixture = check_mixture(DataArguments(train_shards=spec, **given), _args())
    except UsageError as error:
        assert "\n" not in str(error) and str(error)
        return
    if not any(given.values()):  # no weights given: the sources are concatenated
        assert mixture is None
        return
    assert len(mixture.weights) == 3 and all(0 < w <= 1 for w in mixture.weights)
    assert abs(math.fsum(mixture.weights) - 1) < 1e-12


@settings(max_examples=50, derandomize=True, deadline=None)
@given(weights=st.lists(_NUMBERS, max_size=4))
def test_any_weights_give_a_mixture_or_one_line(sources, weights):
    _only_a_mixture_or_one_line("::".join(str(Path(s[0]).parent) for s in sources), train_data_weights=weights)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(factors=st.lists(_WORDS, max_size=4))
def test_any_upsampling_factors_give_a_mixture_or_one_line(sources, factors):
    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    _only_a_mixture_or_one_line(spec, train_data_upsampling_factors=factors)


def test_a_bad_weight_count_stops_disco_clip_train_with_one_line_and_exit_2(sources, tmp_path, capsys):
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR

    spec = "::".join(str(Path(s[0]).parent) for s in sources)
    argv = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--train_shards", spec]
    argv += ["--model_config", str(TINY_CONFIG), "--tokenizer_name", str(TOKENIZER_DIR)]
    assert run_main(main, [*argv, "--train_data_weights", "1", "2"], "disco-clip train") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["disco-clip train: 2 data weight(s) for 3 '::'-joined --train_shards sources: give one each"]


@pytest.mark.parametrize("weighted", [False, True])
def test_the_run_builds_a_resampled_stream_and_a_mixture_from_its_arguments(sources, weighted):
    from disco_clip_ds.train.run import _stream

    urls = [url for source in sources for url in source]
    mixture = _mixture(sources) if weighted else None
    checked = SimpleNamespace(urls=urls, hf=None, naflex=None, image_size=16, mixture=mixture)
    data_args = DataArguments(train_shards="x", dataset_resampled=True, shuffle_buffer=4)
    args = SimpleNamespace(process_index=1, world_size=2, seed=3, dataloader_num_workers=1)
    args.per_device_train_batch_size = 2
    stream = _stream(data_args, args, checked, reads_own_shards=True, split=1, patches=None)
    assert isinstance(stream, MixtureStream if weighted else ShardStream)
    assert stream.resampled and stream.state_facts()["resampled"] is True and stream.rank == 1
    streams = stream.sources if weighted else [stream]
    assert all(s.resampled for s in streams)
