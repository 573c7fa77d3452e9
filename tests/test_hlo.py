"""Tests for loco_jax.hlo: collective bytes read from HLO text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import hlo
from loco_jax.hlo import (
    CollectiveOp,
    CollectiveReport,
    collective_bytes,
    dtype_bytes,
    parse_shape,
    parse_shapes,
)

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_ADD_F32 = """
%add.f32 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}
"""


def _module(body: str, header: str = "num_partitions=8", extra: str = "") -> str:
    return (
        f"HloModule jit_step, is_scheduled=true, entry_computation_layout={{(f32[1024]{{0}})->f32[1024]{{0}}}}, {header}\n"
        + _ADD_F32
        + extra
        + "\nENTRY %main.1_spmd (param: f32[1024]) -> f32[1024] {\n"
        + "  %param = f32[1024]{0} parameter(0), sharding={devices=[8]<=[8]}\n"
        + body
        + "\n}\n"
    )


_BC = (
    'backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
    '"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false},'
    '"force_earliest_schedule":false}'
)

# ---------------------------------------------------------------------------
# Helpers: dtype and shape parsing
# ---------------------------------------------------------------------------


def test_dtype_bytes():
    assert dtype_bytes("pred") == 1
    assert dtype_bytes("u8") == 1
    assert dtype_bytes("f8e4m3fn") == 1
    assert dtype_bytes("f8e5m2") == 1
    assert dtype_bytes("s4") == 0.5
    assert dtype_bytes("u4") == 0.5
    assert dtype_bytes("bf16") == 2
    assert dtype_bytes("f16") == 2
    assert dtype_bytes("s32") == 4
    assert dtype_bytes("f32") == 4
    assert dtype_bytes("f64") == 8
    assert dtype_bytes("c64") == 8
    assert dtype_bytes("c128") == 16
    with pytest.raises(ValueError):
        dtype_bytes("q7")


def test_parse_shape():
    assert parse_shape("f32[4,128]{1,0}") == ("f32", (4, 128))
    assert parse_shape("bf16[8,128]{1,0:T(8,128)(2,1)}") == ("bf16", (8, 128))
    assert parse_shape("f32[]") == ("f32", ())
    assert parse_shapes("(u8[4,100]{1,0}, u8[4,100]{1,0})") == [("u8", (4, 100)), ("u8", (4, 100))]
    assert parse_shapes("((f32[20]{0}), f32[10]{0}, s32[])") == [("f32", (20,)), ("f32", (10,)), ("s32", ())]
    with pytest.raises(ValueError):
        parse_shape("(f32[2], f32[3])")


# ---------------------------------------------------------------------------
# Synthetic GPU-style HLO
# ---------------------------------------------------------------------------


def test_async_all_reduce_pair_counted_once():
    hlo = _module(
        "  %all-reduce-start = f32[1024]{0} all-reduce-start(f32[1024]{0} %param), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.f32, "
        + _BC
        + "\n  ROOT %all-reduce-done = f32[1024]{0} all-reduce-done(f32[1024]{0} %all-reduce-start)"
    )
    rep = collective_bytes(hlo)
    assert isinstance(rep, CollectiveReport)
    assert len(rep.ops) == 1
    op = rep.ops[0]
    assert isinstance(op, CollectiveOp)
    assert op.kind == "all-reduce"
    assert op.dtype == "f32"
    assert op.shape == (1024,)
    assert op.group_size == 4
    assert op.count == 1
    assert op.is_async
    assert op.bytes_per_device == 2 * 3 / 4 * 4096 == 6144
    assert op.total_bytes == 6144
    assert op.computation == "main.1_spmd"
    assert op.context == "entry"
    assert op.branch is None and not op.per_iteration
    assert rep.total == 6144 == rep.total_min


def test_native_async_start_ops_use_result_shape():
    # all-gather-start: (operand, result); collective-permute-start: (in, out, ctx, ctx);
    # sugared reduce-scatter-start: ((operands), result).
    hlo = _module(
        """
  %p.bf = bf16[256]{0} convert(f32[256]{0} %param)
  %all-gather-start = (bf16[256]{0}, bf16[1024]{0}) all-gather-start(bf16[256]{0} %p.bf), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[1024]{0} all-gather-done((bf16[256]{0}, bf16[1024]{0}) %all-gather-start)
  %collective-permute-start = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(f32[256]{0} %param), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[256]{0} collective-permute-done((f32[256]{0}, f32[256]{0}, u32[], u32[]) %collective-permute-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(f32[1024]{0} %param), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add.f32
  %reduce-scatter-update = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-update(((f32[1024]{0}), f32[256]{0}) %reduce-scatter-start)
  ROOT %reduce-scatter-done = f32[256]{0} reduce-scatter-done(((f32[1024]{0}), f32[256]{0}) %reduce-scatter-update)"""
    )
    rep = collective_bytes(hlo)
    kinds = {op.kind: op for op in rep.ops}
    assert len(rep.ops) == 3
    ag = kinds["all-gather"]
    assert (ag.dtype, ag.shape, ag.group_size) == ("bf16", (1024,), 4)
    assert ag.bytes_per_device == 3 / 4 * 2048 == 1536
    cp = kinds["collective-permute"]
    assert (cp.dtype, cp.shape) == ("f32", (256,))
    assert cp.bytes_per_device == 1024
    rs = kinds["reduce-scatter"]
    assert (rs.shape, rs.group_size) == ((256,), 4)
    assert rs.bytes_per_device == 3 * 1024 == 3072
    assert rep.total == 1536 + 1024 + 3072


def test_generic_async_start_wrapper():
    wrapped = """
%all-gather.wrapped (p0: f32[256]) -> f32[2048] {
  %p0 = f32[256]{0} parameter(0)
  ROOT %all-gather.1 = f32[2048]{0} all-gather(f32[256]{0} %p0), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}, execution_thread="parallel"
"""
    hlo = _module(
        """
  %slice = f32[256]{0} slice(f32[1024]{0} %param), slice={[0:256]}
  %all-gather-start = ((f32[256]{0}), f32[2048]{0}, s32[]) async-start(f32[256]{0} %slice), async_execution_thread="parallel", calls=%all-gather.wrapped, """
        + _BC
        + """
  %all-gather-done = f32[2048]{0} async-done(((f32[256]{0}), f32[2048]{0}, s32[]) %all-gather-start), async_execution_thread="parallel", calls=%all-gather.wrapped
  ROOT %slice.2 = f32[1024]{0} slice(f32[2048]{0} %all-gather-done), slice={[0:1024]}""",
        extra=wrapped,
    )
    rep = collective_bytes(hlo)
    assert len(rep.ops) == 1
    op = rep.ops[0]
    assert op.kind == "all-gather"
    assert op.computation == "all-gather.wrapped"
    assert op.group_size == 8
    assert op.shape == (2048,)
    assert op.bytes_per_device == 7 / 8 * 8192 == 7168
    assert op.count == 1
    assert rep.total == 7168


def test_all_to_all_tuple_result():
    hlo = _module(
        """
  %a = u8[4,100]{1,0} parameter(1)
  %b = u8[4,100]{1,0} parameter(2)
  %all-to-all = (u8[4,100]{1,0}, u8[4,100]{1,0}) all-to-all(u8[4,100]{1,0} %a, u8[4,100]{1,0} %b), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}
  ROOT %r = f32[1024]{0} copy(f32[1024]{0} %param)"""
    )
    rep = collective_bytes(hlo)
    (op,) = rep.ops
    assert op.kind == "all-to-all"
    assert op.dtype == "u8"
    assert op.shape == (4, 100)  # first element; all elements in .shapes
    assert op.shapes == ((4, 100), (4, 100))
    assert op.dtypes == ("u8", "u8")
    assert op.payload_bytes == 800
    assert op.group_size == 4
    assert op.bytes_per_device == 3 / 4 * 800 == 600


def test_reduce_scatter_iota_groups_and_transposed_iota():
    hlo = _module(
        """
  %reduce-scatter = f32[256]{0} reduce-scatter(f32[1024]{0} %param), channel_id=5, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add.f32
  ROOT %all-reduce = f32[1024]{0} all-reduce(f32[1024]{0} %param), channel_id=6, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add.f32"""
    )
    rep = collective_bytes(hlo)
    rs = rep.filter(kind="reduce-scatter")[0]
    assert rs.group_size == 4
    assert rs.bytes_per_device == 3 * 1024 == 3072
    ar = rep.filter(kind="all-reduce")[0]
    assert ar.group_size == 2
    assert ar.bytes_per_device == 2 * 1 / 2 * 4096 == 4096
    assert rep.total == 3072 + 4096
    assert rep.by_kind() == {"reduce-scatter": 3072, "all-reduce": 4096}


def test_empty_groups_use_module_header():
    hlo = _module(
        """
  %all-reduce = f32[1024]{0} all-reduce(f32[1024]{0} %param), channel_id=7, replica_groups={}, use_global_device_ids=true, to_apply=%add.f32
  %all-gather = f32[8192]{0} all-gather(f32[1024]{0} %param), channel_id=8, dimensions={0}, use_global_device_ids=true
  ROOT %all-to-all = f32[1024]{0} all-to-all(f32[1024]{0} %param), channel_id=9, replica_groups={}, dimensions={0}""",
        header="replica_count=1, num_partitions=8",
    )
    rep = collective_bytes(hlo)
    assert rep.num_partitions == 8 and rep.replica_count == 1
    ar, ag, a2a = rep.ops
    assert ar.group_size == ag.group_size == a2a.group_size == 8
    assert ar.bytes_per_device == 2 * 7 / 8 * 4096 == 7168
    assert ag.bytes_per_device == 7 / 8 * 32768 == 28672
    assert a2a.bytes_per_device == 7 / 8 * 4096 == 3584


def test_cross_replica_groups_without_channel_id():
    # pmap-style: no channel_id -> groups index replicas; empty = replica_count.
    hlo = _module(
        "  ROOT %all-reduce = f32[1024]{0} all-reduce(f32[1024]{0} %param), replica_groups={}, to_apply=%add.f32",
        header="replica_count=4",
    )
    (op,) = collective_bytes(hlo).ops
    assert op.group_size == 4
    assert op.bytes_per_device == 2 * 3 / 4 * 4096


_COND_LT = """
%cond.{tag} (p.{tag}: (s32[], f32[1024])) -> pred[] {{
  %p.{tag} = (s32[], f32[1024]{{0}}) parameter(0)
  %i.{tag} = s32[] get-tuple-element((s32[], f32[1024]{{0}}) %p.{tag}), index=0
  %n.{tag} = s32[] constant({n})
  ROOT %lt.{tag} = pred[] compare(s32[] %i.{tag}, s32[] %n.{tag}), direction=LT
}}
"""


def _body(tag: str, inner: str) -> str:
    return f"""
%body.{tag} (q.{tag}: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %q.{tag} = (s32[], f32[1024]{{0}}) parameter(0)
  %i.b{tag} = s32[] get-tuple-element((s32[], f32[1024]{{0}}) %q.{tag}), index=0
  %v.{tag} = f32[1024]{{0}} get-tuple-element((s32[], f32[1024]{{0}}) %q.{tag}), index=1
  %one.{tag} = s32[] constant(1)
  %inc.{tag} = s32[] add(s32[] %i.b{tag}, s32[] %one.{tag})
{inner}
}}
"""


def _while(name: str, tag: str, operand: str, trip: int | None) -> str:
    bc = (
        f', backend_config={{"known_trip_count":{{"n":"{trip}"}},"known_init_step":{{"init":"0","step":"1"}},'
        f'"known_induction_variable":{{"tuple_index":"0"}}}}'
        if trip is not None
        else ""
    )
    return (
        f"  %{name} = (s32[], f32[1024]{{0}}) while((s32[], f32[1024]{{0}}) {operand}), "
        f"condition=%cond.{tag}, body=%body.{tag}{bc}"
    )


_AR_BODY = """  %ar.{tag} = f32[1024]{{0}} all-reduce(f32[1024]{{0}} %v.{tag}), channel_id=1{tag}, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add.f32
  ROOT %t.{tag} = (s32[], f32[1024]{{0}}) tuple(s32[] %inc.{tag}, f32[1024]{{0}} %ar.{tag})"""


def _entry_while(trip):
    return (
        "  %zero = s32[] constant(0)\n"
        "  %init = (s32[], f32[1024]{0}) tuple(s32[] %zero, f32[1024]{0} %param)\n"
        + _while("while.1", "A", "%init", trip)
        + "\n  ROOT %out = f32[1024]{0} get-tuple-element((s32[], f32[1024]{0}) %while.1), index=1"
    )


def test_while_known_trip_count():
    extra = _COND_LT.format(tag="A", n=5) + _body("A", _AR_BODY.format(tag="A"))
    rep = collective_bytes(_module(_entry_while(5), extra=extra))
    (op,) = rep.ops
    assert op.count == 5
    assert op.bytes_per_device == 6144
    assert op.total_bytes == 5 * 6144 == 30720
    assert op.context == "while body x5"
    assert op.computation == "body.A"
    assert not op.per_iteration
    assert rep.total == 30720


def test_while_unknown_trip_count_is_per_iteration():
    extra = _COND_LT.format(tag="A", n=5) + _body("A", _AR_BODY.format(tag="A"))
    rep = collective_bytes(_module(_entry_while(None), extra=extra))
    (op,) = rep.ops
    assert op.count == 1
    assert op.per_iteration
    assert "unknown" in op.context
    assert op.total_bytes == 6144
    assert rep.has_unknown_trip_counts
    assert "/iter" in rep.table()


def test_trip_count_from_frontend_attributes():
    extra = _COND_LT.format(tag="A", n=6) + _body("A", _AR_BODY.format(tag="A"))
    body = _entry_while(None).replace(
        "body=%body.A", 'body=%body.A, frontend_attributes={_xla_known_trip_count="6"}'
    )
    (op,) = collective_bytes(_module(body, extra=extra)).ops
    assert op.count == 6 and not op.per_iteration


def test_nested_while_multiplies():
    # outer (x3): all-gather + inner while (x4) holding an all-reduce;
    # a second inner while without trip count holding another all-reduce.
    inner_b = _AR_BODY.format(tag="B")
    inner_c = _AR_BODY.format(tag="C")
    outer_inner = (
        "  %ag.A = f32[8192]{0} all-gather(f32[1024]{0} %v.A), channel_id=20, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true\n"
        "  %init.A = (s32[], f32[1024]{0}) tuple(s32[] %inc.A, f32[1024]{0} %v.A)\n"
        + _while("while.B", "B", "%init.A", 4)
        + "\n"
        + _while("while.C", "C", "%while.B", None)
        + "\n  ROOT %t.A = (s32[], f32[1024]{0}) tuple(s32[] %inc.A, f32[1024]{0} %v.A)"
    )
    extra = (
        _COND_LT.format(tag="B", n=4)
        + _body("B", inner_b)
        + _COND_LT.format(tag="C", n=9)
        + _body("C", inner_c)
        + _COND_LT.format(tag="A", n=3)
        + _body("A", outer_inner)
    )
    rep = collective_bytes(_module(_entry_while(3), extra=extra))
    ag = rep.filter(kind="all-gather")[0]
    assert ag.count == 3
    assert ag.bytes_per_device == 7 / 8 * 32768 == 28672
    ar_b = [op for op in rep.ops if op.computation == "body.B"][0]
    assert ar_b.count == 12
    assert ar_b.context == "while body x3 > while body x4"
    assert ar_b.total_bytes == 12 * 6144
    ar_c = [op for op in rep.ops if op.computation == "body.C"][0]
    assert ar_c.count == 3 and ar_c.per_iteration
    assert rep.total == 3 * 28672 + 12 * 6144 + 3 * 6144


_BRANCHES = """
%branch_0 (b0: (f32[1024])) -> (f32[1024]) {
  %b0 = (f32[1024]{0}) parameter(0)
  %g0 = f32[1024]{0} get-tuple-element((f32[1024]{0}) %b0), index=0
  %ar.b0 = f32[1024]{0} all-reduce(f32[1024]{0} %g0), channel_id=31, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.f32
  ROOT %t.b0 = (f32[1024]{0}) tuple(f32[1024]{0} %ar.b0)
}

%branch_1 (b1: (f32[1024])) -> (f32[1024]) {
  %b1 = (f32[1024]{0}) parameter(0)
  %g1 = f32[1024]{0} get-tuple-element((f32[1024]{0}) %b1), index=0
  %u = u8[100]{0} parameter(1)
  %ag.b1 = u8[400]{0} all-gather(u8[100]{0} %u), channel_id=32, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %t.b1 = (f32[1024]{0}) tuple(f32[1024]{0} %g1)
}

%branch_2 (b2: (f32[1024])) -> (f32[1024]) {
  %b2 = (f32[1024]{0}) parameter(0)
  ROOT %t.b2 = (f32[1024]{0}) copy((f32[1024]{0}) %b2)
}

%unreachable (z: f32[1024]) -> f32[1024] {
  %z = f32[1024]{0} parameter(0)
  ROOT %ar.z = f32[1024]{0} all-reduce(f32[1024]{0} %z), channel_id=99, replica_groups={}, use_global_device_ids=true, to_apply=%add.f32
}
"""


def test_conditional_branches_take_max_not_sum():
    body = """
  %idx = s32[] constant(1)
  %tup = (f32[1024]{0}) tuple(f32[1024]{0} %param)
  %cp = f32[256]{0} slice(f32[1024]{0} %param), slice={[0:256]}
  %perm = f32[256]{0} collective-permute(f32[256]{0} %cp), channel_id=30, source_target_pairs={{0,1},{1,0}}
  %conditional.3 = (f32[1024]{0}) conditional(s32[] %idx, (f32[1024]{0}) %tup, (f32[1024]{0}) %tup), branch_computations={%branch_0, %branch_1}
  ROOT %res = f32[1024]{0} get-tuple-element((f32[1024]{0}) %conditional.3), index=0"""
    rep = collective_bytes(_module(body, extra=_BRANCHES))
    assert len(rep.ops) == 3  # unreachable computation and to_apply ignored
    perm = rep.filter(kind="collective-permute")[0]
    assert perm.branch is None and perm.bytes_per_device == 1024
    b0 = rep.filter(kind="all-reduce")[0]
    b1 = rep.filter(kind="all-gather")[0]
    assert b0.branch == "conditional.3:0" and b1.branch == "conditional.3:1"
    assert b0.context == "conditional branch 0 of conditional.3"
    assert b0.bytes_per_device == 6144
    assert b1.bytes_per_device == 300
    assert rep.total == 1024 + 6144  # max over branches
    assert rep.total_min == 1024 + 300
    assert rep.total_all_branches == 1024 + 6144 + 300
    assert rep.by_kind() == {"collective-permute": 1024, "all-reduce": 6144}
    assert sum(rep.by_kind().values()) == rep.total
    assert rep.by_kind("min") == {"collective-permute": 1024, "all-gather": 300}
    assert rep.by_dtype("all") == {"f32": 1024 + 6144, "u8": 300}
    text = rep.table()
    assert "conditional branch 1 of conditional.3" in text
    assert str(rep) == text


def test_conditional_empty_branch_and_inside_while():
    # a 3-way conditional (branch 2 has no collective) inside a while x4;
    # pred-style true/false conditional at entry level.
    inner = (
        "  %tup.A = (f32[1024]{0}) tuple(f32[1024]{0} %v.A)\n"
        "  %c.A = (f32[1024]{0}) conditional(s32[] %i.bA, (f32[1024]{0}) %tup.A, (f32[1024]{0}) %tup.A, (f32[1024]{0}) %tup.A), "
        "branch_computations={%branch_0, %branch_1, %branch_2}\n"
        "  ROOT %t.A = (s32[], f32[1024]{0}) tuple(s32[] %inc.A, f32[1024]{0} %v.A)"
    )
    extra = _BRANCHES + _COND_LT.format(tag="A", n=4) + _body("A", inner)
    body = (
        "  %pred = pred[] constant(true)\n"
        "  %tup = (f32[1024]{0}) tuple(f32[1024]{0} %param)\n"
        "  %cond.top = (f32[1024]{0}) conditional(pred[] %pred, (f32[1024]{0}) %tup, (f32[1024]{0}) %tup), "
        "true_computation=%branch_1, false_computation=%branch_2\n" + _entry_while(4)
    )
    rep = collective_bytes(_module(body, extra=extra))
    top = [op for op in rep.ops if op.branch == "cond.top:0"]
    assert len(top) == 1 and top[0].kind == "all-gather" and top[0].count == 1
    assert "0 (true)" in top[0].context
    loop_ar = [op for op in rep.ops if op.branch == "while.1/c.A:0"][0]
    assert loop_ar.count == 4 and loop_ar.context == "while body x4 > conditional branch 0 of c.A"
    assert rep.total == 300 + 4 * 6144
    assert rep.total_min == 0  # both conditionals have a collective-free branch


def test_multiline_instruction_and_no_percent_names():
    hlo = """HloModule m, is_scheduled=true, num_partitions=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  p = bf16[4096] parameter(0)
  rss = ((bf16[4096]), bf16[1024]) reduce-scatter-start(p), channel_id=1,
      replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, to_apply={
    x = bf16[] parameter(0)
    y = bf16[] parameter(1)
    ROOT o = bf16[] add(x, y)
  }
  ROOT rsd = bf16[1024] reduce-scatter-done(rss)
}
"""
    (op,) = collective_bytes(hlo).ops
    assert op.kind == "reduce-scatter" and op.dtype == "bf16" and op.shape == (1024,)
    assert op.bytes_per_device == 3 * 2048


# ---------------------------------------------------------------------------
# Real programs compiled for the 8 CPU devices
# ---------------------------------------------------------------------------

SPEC = P(("replica", "data"))


def _compile(mesh, f, x, in_spec=SPEC, out_spec=SPEC):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=True))
    x = jax.device_put(x, NamedSharding(mesh, in_spec))
    return g.lower(x)


def test_real_psum(mesh):
    lowered = _compile(mesh, lambda x: lax.psum(x, "data"), jnp.ones((8 * 1024,), jnp.float32), out_spec=P("replica"))
    compiled = lowered.compile()
    rep = collective_bytes(compiled)
    (op,) = rep.ops
    assert op.kind == "all-reduce"
    assert op.dtype == "f32"
    assert op.shape == (1024,)
    assert op.group_size == 4
    assert op.count == 1
    assert op.bytes_per_device == 2 * 3 / 4 * 4096 == 6144
    assert rep.total == 6144
    # Lowered and text give the same report.
    assert collective_bytes(lowered).total == 6144
    assert collective_bytes(compiled.as_text()).ops == rep.ops
    print("\n" + str(rep))


def test_real_psum_8way(data_mesh):
    lowered = _compile(data_mesh, lambda x: lax.psum(x, "data"), jnp.ones((8 * 256,), jnp.float32), P("data"), P())
    (op,) = collective_bytes(lowered).ops
    assert op.group_size == 8
    assert op.bytes_per_device == 2 * 7 / 8 * 1024


def test_real_all_gather_uint8(mesh):
    lowered = _compile(mesh, lambda x: lax.all_gather(x, "data", tiled=True), jnp.ones((8 * 100,), jnp.uint8))
    (op,) = collective_bytes(lowered).ops
    assert op.kind == "all-gather"
    assert op.dtype == "u8"
    assert op.shape == (400,)
    assert op.group_size == 4
    assert op.bytes_per_device == 3 / 4 * 400 == 300


def test_real_all_to_all_uint8(mesh):
    lowered = _compile(mesh, lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True), jnp.ones((8 * 400,), jnp.uint8))
    (op,) = collective_bytes(lowered).ops
    assert op.kind == "all-to-all"
    assert op.dtype == "u8"
    assert op.group_size == 4
    assert op.payload_bytes == 400  # CPU emits a 4-tuple of u8[100]; summed
    assert op.bytes_per_device == 3 / 4 * 400 == 300


def test_real_psum_scatter(mesh):
    lowered = _compile(mesh, lambda x: lax.psum_scatter(x, "data", tiled=True), jnp.ones((8 * 1024,), jnp.float32))
    (op,) = collective_bytes(lowered).ops
    assert op.kind == "reduce-scatter"
    assert op.shape == (256,)
    assert op.group_size == 4
    assert op.bytes_per_device == 3 * 1024 == 3072


def test_real_ppermute(mesh):
    perm = [(i, (i + 1) % 4) for i in range(4)]
    lowered = _compile(mesh, lambda x: lax.ppermute(x, "data", perm), jnp.ones((8 * 1024,), jnp.float32))
    (op,) = collective_bytes(lowered).ops
    assert op.kind == "collective-permute"
    assert op.bytes_per_device == 4096


def _check_loop(rep, trip):
    (op,) = rep.ops
    assert op.kind == "all-reduce"
    assert op.bytes_per_device == 6144
    if op.per_iteration:  # XLA did not record the trip count
        assert op.count == 1
    else:
        assert op.count == trip
        assert op.context == f"while body x{trip}"
        assert rep.total == trip * 6144


def test_real_fori_loop(mesh):
    def f(x):
        return lax.fori_loop(0, 5, lambda i, c: c * 0.5 + lax.psum(c, "data"), x)

    _check_loop(collective_bytes(_compile(mesh, f, jnp.ones((8 * 1024,), jnp.float32))), 5)


def test_real_scan(mesh):
    def f(x):
        return lax.scan(lambda c, _: (c * 0.5 + lax.psum(c, "data"), None), x, None, length=7)[0]

    _check_loop(collective_bytes(_compile(mesh, f, jnp.ones((8 * 1024,), jnp.float32))), 7)


def test_real_while_unknown_trip_count(mesh):
    def f(x):
        def body(c):
            return c * 0.5 + lax.psum(c, "data")

        return lax.while_loop(lambda c: c[0] < 100.0, body, x)

    (op,) = collective_bytes(_compile(mesh, f, jnp.ones((8 * 1024,), jnp.float32))).ops
    assert op.per_iteration and op.count == 1
    assert op.total_bytes == 6144


def test_real_cond(mesh):
    def f(x):
        return lax.cond(x[0] > 0, lambda c: c + lax.psum(c, "data"), lambda c: c * 2, x)

    rep = collective_bytes(_compile(mesh, f, jnp.ones((8 * 1024,), jnp.float32)))
    (op,) = rep.ops
    assert op.kind == "all-reduce"
    assert op.branch is not None
    assert rep.total == 6144
    assert rep.total_min == 0


def test_real_bf16_psum_dtype(mesh):
    lowered = _compile(mesh, lambda x: lax.psum(x, "data"), jnp.ones((8 * 1024,), jnp.bfloat16), out_spec=P("replica"))
    (op,) = collective_bytes(lowered).ops
    print(f"\nbf16 psum on {jax.default_backend()} is emitted as a {op.dtype} all-reduce")
    assert op.dtype in ("bf16", "f32")
    assert op.bytes_per_device == 2 * 3 / 4 * 1024 * dtype_bytes(op.dtype)
    np.testing.assert_allclose(op.total_bytes, op.bytes_per_device)


def test_replica_groups_and_which_ops_cross_replicas(mesh):
    assert hlo.replica_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert hlo.replica_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert hlo.replica_groups("{}") is None

    def both(x):
        return jax.lax.psum(x, "data") + jax.lax.psum(x, "replica")

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(("replica", "data")), out_specs=P(("replica", "data"))))
    x = jax.device_put(np.ones(8 * 16, np.float32), jax.NamedSharding(mesh, P(("replica", "data"))))
    ops = hlo.collective_bytes(f.lower(x).compile()).ops
    crossing = [op for op in ops if op.spans(4)]  # D = 4 data devices per replica
    inside = [op for op in ops if not op.spans(4)]
    assert len(crossing) == 1 and crossing[0].group_size == 2
    assert len(inside) == 1 and inside[0].group_size == 4


_ORDER_HLO = """HloModule order, replica_count=1, num_partitions=4

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8]) %t), index=0
  %v = f32[8]{0} get-tuple-element((s32[], f32[8]) %t), index=1
  %r1 = f32[8]{0} all-reduce(f32[8]{0} %v), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%sum
  %r2 = f32[8]{0} all-reduce(f32[8]{0} %v), channel_id=6, replica_groups={{0,1,2,3}}, to_apply=%sum
  %s = f32[8]{0} add(f32[8]{0} %r1, f32[8]{0} %r2)
  ROOT %out = (s32[], f32[8]) tuple(s32[] %i, f32[8]{0} %s)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]) parameter(0)
  ROOT %p = pred[] constant(false)
}

ENTRY %main (x: f32[8], y: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %ax = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%sum
  %ay = f32[8]{0} all-reduce(f32[8]{0} %y), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%sum, control-predecessors={%ax}
  %z = f32[8]{0} add(f32[8]{0} %ax, f32[8]{0} %ay)
  %az = f32[8]{0} all-gather(f32[8]{0} %z), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %ay2 = f32[8]{0} all-reduce(f32[8]{0} %y), channel_id=4, replica_groups={{0,1,2,3}}, to_apply=%sum
  %c = s32[] constant(0)
  %t0 = (s32[], f32[8]) tuple(s32[] %c, f32[8]{0} %az)
  %w = (s32[], f32[8]) while((s32[], f32[8]) %t0), condition=%cond, body=%body
  %wv = f32[8]{0} get-tuple-element((s32[], f32[8]) %w), index=1
  ROOT %r = f32[8]{0} add(f32[8]{0} %wv, f32[8]{0} %ay2)
}
"""


def test_unordered_collectives_follow_operands_and_control_predecessors_into_loops():
    """ax -> ay by a control predecessor, both -> az -> the loop by operands: ordered. ay2 depends on none
    of them (and the loop not on it): unordered with each. Inside the loop body r1 and r2 both read v only."""
    pairs = {(p.computation, frozenset((p.first, p.second))) for p in hlo.unordered_collectives(_ORDER_HLO)}
    assert pairs == {("main", frozenset(("ay2", other))) for other in ("ax", "ay", "az", "w")} | {
        ("body", frozenset(("r1", "r2")))}
    ordered = _ORDER_HLO.replace("%ay2 = f32[8]{0} all-reduce(f32[8]{0} %y)", "%ay2 = f32[8]{0} all-reduce(f32[8]{0} %az)")
    ordered = ordered.replace("channel_id=6, replica_groups={{0,1,2,3}}, to_apply=%sum",
                              "channel_id=6, replica_groups={{0,1,2,3}}, to_apply=%sum, control-predecessors={%r1}")
    ordered = ordered.replace("%w = (s32[], f32[8]) while((s32[], f32[8]) %t0)",
                              "%w = (s32[], f32[8]) while((s32[], f32[8]) %t0), control-predecessors={%ay2}")
    assert hlo.unordered_collectives(ordered) == []
    # a reduction whose every group is one device (an axis of size 1) waits for no other: not a site
    alone = _ORDER_HLO.replace("channel_id=4, replica_groups={{0,1,2,3}}", "channel_id=4, replica_groups={{0},{1},{2},{3}}")
    assert {(p.computation, frozenset((p.first, p.second))) for p in hlo.unordered_collectives(alone)} == {
        ("body", frozenset(("r1", "r2")))}
