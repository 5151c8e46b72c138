import pytest

from shardviz.geometry.placement import Placement, normalize, parse


@pytest.mark.parametrize(
    "text, expected",
    [
        ("S(0)", Placement("shard", dim=0)),
        ("S(-1)", Placement("shard", dim=-1)),
        ("R", Placement("replicate")),
        ("P", Placement("partial", reduce_op="sum")),
        ("P(avg)", Placement("partial", reduce_op="avg")),
        ("P(max)", Placement("partial", reduce_op="max")),
        ("_S(1,sf=4)", Placement("strided", dim=1, split_factor=4)),
        ("_S(1, 4)", Placement("strided", dim=1, split_factor=4)),
        (" S( 2 ) ", Placement("shard", dim=2)),
    ],
)
def test_parse(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("p", ["S(0)", "R", "P(sum)", "P(min)", "_S(0,sf=2)"])
def test_round_trip(p):
    assert str(parse(p)) == p


@pytest.mark.parametrize("bad", ["Shard(0)", "S", "S(x)", "X", "", "P(mean)", "_S(0,sf=0)"])
def test_bad_strings_name_the_forms(bad):
    with pytest.raises(ValueError) as e:
        parse(bad)
    assert repr(bad) in str(e.value) or "split factor" in str(e.value)


def test_non_string():
    with pytest.raises(TypeError, match="not a string"):
        parse(3)  # type: ignore[arg-type]


def test_normalize_resolves_negative_dims():
    assert normalize(["S(-1)", "R"], ndim=3, mesh_ndim=2) == (
        Placement("shard", dim=2),
        Placement("replicate"),
    )


def test_normalize_checks_counts_and_dims():
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        normalize(["S(0)"], ndim=2, mesh_ndim=2)
    with pytest.raises(ValueError, match="shards dim 2, but the tensor has 2 dim"):
        normalize(["S(2)"], ndim=2, mesh_ndim=1)
    with pytest.raises(ValueError, match="mix Partial reduce ops"):
        normalize(["P(sum)", "P(max)"], ndim=1, mesh_ndim=2)
    with pytest.raises(TypeError, match="list of strings"):
        normalize(3, ndim=1, mesh_ndim=1)
