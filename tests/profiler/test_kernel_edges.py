"""The profiler samples both sides of the row counts where the executor's matmuls switch kernel,
and records them for the fit (``metadata["kernel_rows"]``, profiler version 8)."""

from types import SimpleNamespace

from laser import profiler
from laser.latency.features import kernel_rows_from_metadata
from laser.profiler.pipeline import kernel_rows_of


def fake_model(layer_rows, head_rows=None):
    """Layers whose four projections switch kernel at ``layer_rows`` (None: no switch), and a
    quantized LM head switching at ``head_rows`` (None: a dense head)."""
    lin = SimpleNamespace(kernel_max_rows=layer_rows) if layer_rows else SimpleNamespace(wt=None)
    layer = SimpleNamespace(qkv=lin, o=lin, gate_up=lin, down=lin)
    head = SimpleNamespace(kernel_max_rows=head_rows) if head_rows else None
    return SimpleNamespace(layers=[layer, layer], lm_head_q=head)


def test_kernel_rows_of_a_model():
    assert kernel_rows_of(fake_model(64, 32)) == {"stateless": [64], "head": [32]}
    assert kernel_rows_of(fake_model(None)) == {"stateless": [], "head": []}
    packed = SimpleNamespace(wt=object(), PACKED_MAX_ROWS=64)  # fp32 Linear with its packed layout
    m = SimpleNamespace(layers=[SimpleNamespace(qkv=packed, o=packed, gate_up=packed, down=packed)])
    assert kernel_rows_of(m) == {"stateless": [64], "head": []}
    # what the fit reads back from a profile's metadata
    assert kernel_rows_from_metadata({"kernel_rows": kernel_rows_of(fake_model(64, 32))}) == {
        "stateless": (64,), "head": (32,)}


def test_grid_samples_both_sides_of_a_kernel_switch():
    g = profiler.ProfileGrid.default(max_tokens=2048, max_batch=64)
    assert len([r for r in g.head_rows if r > 8]) >= 10  # enough past the small-count lookup for CV
    g.add_kernel_edges({"stateless": [64], "head": [32, 500]})
    assert {63, 64, 65, 72} <= set(g.stateless_tokens)
    assert {31, 32, 33, 40} <= set(g.head_rows) and max(g.head_rows) == 128  # none past the grid's range
    assert g.stateless_tokens == sorted(set(g.stateless_tokens))
