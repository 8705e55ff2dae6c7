"""The multi-GPU placement core (coli/gpu/partition.py, issue 18) and the `--gpus` helper (coli/gpu/gpu_select.py):
every (MoE layer, expert) owned by exactly one GPU, each GPU's parts summing to its budget, the copy balance of
both partitions from uniform routing (checked against brute-force enumeration of every top-k subset) and from a
routing trace (checked against counting the trace directly), hand-offs that follow from the placement, one GPU
agreeing with the one-GPU `coli plan`, and refusals that name the GPU."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from coli.config import preset
from coli.errors import ColiError
from coli.gpu.gpu_select import AUTO, parse_gpus, per_gpu, resolve_gpus, visible_gpus
from coli.gpu.partition import (GB, Geometry, GpuBudget, PartitionError, PartitionOptions, assign_experts, choose,
                                make_partition, uniform_layer_stats)
from coli.plan import Hardware, PlanOptions, dense_core_bytes, dense_core_parts, make_plan, partition_geometry, \
    sizes_from_config
from coli.traces_synth import glm52

EPS = np.finfo(np.float64).eps


def _geom(name: str, context: int = 8192, dense: str = "int4"):
    cfg = preset(name)
    sizes = sizes_from_config(cfg, f"preset {name}", dense=dense)
    return cfg, sizes, partition_geometry(cfg, sizes, min(context, sizes.max_context))


@pytest.fixture(scope="module")
def glm5():
    return _geom("glm5")


@pytest.fixture(scope="module")
def tiny():
    return _geom("tiny")


def check_plan(p, geom: Geometry, gpus: list[GpuBudget]) -> None:
    """Every identity a placement must satisfy."""
    L, E, xb = len(geom.moe_layers), geom.experts_per_layer, geom.record_bytes
    index = [g.index for g in gpus]
    owner = np.asarray(p.owner)
    assert owner.shape == (L, E) and set(np.unique(owner)) <= set(index)   # one owner per (layer, expert)
    assert len(p.home) == len(geom.layer_types) and set(p.home) <= set(index)
    assert sum(g["experts_owned"] for g in p.gpus) == L * E
    assert sum(g["dense_core"] for g in p.gpus) == geom.dense_bytes
    assert sum(g["kv_cache"] for g in p.gpus) == geom.kv_bytes
    assert sum(g["embedding"] for g in p.gpus) == 1 and sum(g["lm_head"] for g in p.gpus) == 1
    for g, b in zip(p.gpus, gpus):
        assert g["index"] == b.index
        assert int((owner == b.index).sum()) == g["experts_owned"]
        assert g["reserve"] + g["dense_core"] + g["kv_cache"] + g["expert_slot_bytes"] + g["free"] == b.vram_bytes
        assert min(g["reserve"], g["dense_core"], g["kv_cache"], g["free"]) >= 0
        assert g["expert_slot_bytes"] == g["expert_slots"] * xb
        assert g["free"] < xb or g["expert_slots"] == g["experts_owned"]   # the pool takes what is left
        assert g["expert_slots"] >= min(2 * geom.experts_per_token, g["experts_owned"])
        layers = [i for i, h in enumerate(p.home) if h == b.index]
        assert g["dense_core"] == sum(geom.dense_layer_bytes[i] for i in layers) + \
            geom.embed_bytes * g["embedding"] + geom.lm_head_bytes * g["lm_head"]
    assert math.isclose(sum(g["copies_per_token"] for g in p.gpus), p.per_token["routed_experts"])
    json.loads(json.dumps(p.to_dict()))


# ---- geometry ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["glm5", "tiny", "tiny-shared"])
@pytest.mark.parametrize("dense", ["int4", "int8", "bf16"])
def test_dense_parts_sum_to_the_converters_dense_core(name, dense):
    cfg = preset(name)
    embed, layers, head = dense_core_parts(cfg, dense)
    assert len(layers) == cfg.num_hidden_layers and min(layers) > 0 and embed > 0 and head > 0
    assert embed + sum(layers) + head == dense_core_bytes(cfg, dense)


@pytest.mark.parametrize("name", ["glm5", "tiny", "tiny-shared"])
def test_geometry_kv_per_layer_sums_to_the_models_kv(name):
    cfg, sizes, g = _geom(name, context=1000)
    assert g.kv_bytes == cfg.kv_values_per_token() * 2 * 1000
    assert g.dense_bytes == sizes.dense_bytes and g.moe_layers == cfg.moe_layers
    assert g.record_bytes == sizes.expert_bytes


# ---- placement identities ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["layer", "expert"])
@pytest.mark.parametrize("budgets,links", [((16, 24), (55, 55)), ((24, 24, 24), (55, 25, 25)), ((80,), (55,))])
def test_glm5_placements_hold_every_identity(glm5, by, budgets, links):
    _, _, geom = glm5
    gpus = [GpuBudget(i, int(b * GB), l) for i, (b, l) in enumerate(zip(budgets, links))]
    check_plan(make_partition(geom, gpus, PartitionOptions(experts_by=by)), geom, gpus)


@pytest.mark.parametrize("name", ["tiny", "tiny-shared", "tiny-groups"])
@pytest.mark.parametrize("by,dense", [("layer", "auto"), ("layer", "whole"), ("expert", "auto"), ("expert", "split")])
def test_tiny_placements_hold_every_identity(name, by, dense):
    _, _, geom = _geom(name)
    gpus = [GpuBudget(3, int(1.1 * GB), 25.0), GpuBudget(1, int(1.2 * GB), 25.0), GpuBudget(0, int(1.3 * GB), 55.0)]
    p = make_partition(geom, gpus, PartitionOptions(experts_by=by, dense=dense))
    check_plan(p, geom, gpus)
    assert p.dense == ("whole" if dense == "whole" or (by, dense) == ("expert", "auto") else "split")


def test_gpu_indices_are_kept_as_given_not_renumbered(tiny):
    _, _, geom = tiny
    gpus = [GpuBudget(5, int(2 * GB), 25.0), GpuBudget(2, int(2 * GB), 25.0)]
    p = make_partition(geom, gpus, PartitionOptions(experts_by="layer"))
    assert [g["index"] for g in p.gpus] == [5, 2] and set(np.unique(p.owner)) == {5, 2}
    assert p.home[0] == 5 and p.home[-1] == 2


def test_one_gpu_agrees_with_the_one_gpu_plan(glm5):
    _, sizes, geom = glm5
    for vram in (16, 24, 80):
        single = make_plan(sizes, Hardware(vram_gb=vram, ram_gb=512, disk_gbps=6, pcie_gbps=55), PlanOptions(context=8192))
        for by in ("layer", "expert"):
            p = make_partition(geom, [GpuBudget(0, int(vram * GB), 55.0)], PartitionOptions(experts_by=by))
            g = p.gpus[0]
            assert g["expert_slots"] == single.slots["vram"] and g["free"] == single.vram["free"]
            assert g["dense_core"] == single.vram["dense_core"] and g["kv_cache"] == single.vram["kv_cache"]
            assert math.isclose(p.tokens_per_s["cold_one_sequence"], single.tokens_per_s["all_cold_pcie"])
            assert p.handoffs["crossings"] == 0 and p.tokens_per_s["speedup_cold_one_sequence"] == pytest.approx(1.0)


# ---- balance, uniform routing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("owned,k,cost", [((3, 2), 2, (1.0, 1.0)), ((3, 2, 4), 3, (1.0, 2.0, 0.5)),
                                          ((5, 1, 2, 4), 4, (0.3, 0.7, 1.1, 0.2)), ((6,), 3, (2.0,))])
def test_uniform_layer_stats_equal_brute_force_over_every_top_k_subset(owned, k, cost):
    gpu_of = [g for g, o in enumerate(owned) for _ in range(o)]
    subsets = list(itertools.combinations(range(len(gpu_of)), k))
    exp_max = sum(Fraction(max(sum(1 for e in s if gpu_of[e] == g) * Fraction(cost[g]) for g in range(len(owned))))
                  for s in subsets) / len(subsets)
    p_any = [Fraction(sum(1 for s in subsets if any(gpu_of[e] == g for e in s)), len(subsets)) for g in range(len(owned))]
    got_max, got_any = uniform_layer_stats(owned, k, cost)
    n_terms = math.comb(k + len(owned) - 1, len(owned) - 1)
    assert abs(got_max - float(exp_max)) <= 4 * n_terms * EPS * float(exp_max)   # a float64 sum of n_terms products
    for g, p in zip(got_any, p_any):
        assert abs(g - float(p)) <= 4 * EPS


def test_expert_ids_split_by_link_share_and_layers_by_copies(glm5):
    _, _, geom = glm5
    L, E, K = len(geom.moe_layers), geom.experts_per_layer, geom.experts_per_token
    gpus = [GpuBudget(0, int(80 * GB), 55.0), GpuBudget(1, int(80 * GB), 25.0)]
    share = [55 / 80, 25 / 80]
    by_expert = assign_experts(geom, gpus, "expert")
    for l in range(L):
        for g in range(2):
            assert abs((by_expert[l] == g).sum() - share[g] * E) <= 1   # largest remainder: within one expert
    by_layer = assign_experts(geom, gpus, "layer")
    assert (by_layer == by_layer[:, :1]).all() and (np.diff(by_layer[:, 0]) >= 0).all()   # contiguous ranges
    for g in range(2):   # a cut lands at the nearest layer boundary: within half a layer's copies of the target
        assert abs((by_layer[:, 0] == g).sum() * K - share[g] * L * K) <= K / 2 + 1e-9


def test_two_equal_gpus_by_expert_id_beat_one_link_for_one_sequence_and_by_layer_does_not(glm5):
    _, _, geom = glm5
    L, K, xb = len(geom.moe_layers), geom.experts_per_token, geom.record_bytes
    gpus = [GpuBudget(0, int(24 * GB), 55.0), GpuBudget(1, int(24 * GB), 55.0)]
    lay = make_partition(geom, gpus, PartitionOptions(experts_by="layer"))
    exp = make_partition(geom, gpus, PartitionOptions(experts_by="expert"))
    one = 55 * GB / (L * K * xb)
    assert math.isclose(lay.tokens_per_s["cold_one_sequence"], one)        # one link at a time
    # by expert id, 128 of 256 each: the layer waits for the larger of the two hypergeometric halves
    e_max = sum(math.comb(128, n) * math.comb(128, K - n) * max(n, K - n) for n in range(K + 1)) / math.comb(256, K)
    assert math.isclose(exp.tokens_per_s["speedup_cold_one_sequence"], K / e_max, rel_tol=64 * EPS)
    assert math.isclose(exp.tokens_per_s["speedup_cold_pipelined"], 2.0, rel_tol=64 * EPS)
    c = choose(geom, gpus)
    assert c.chosen.partition == "expert" and set(c.candidates) == {"layer", "expert"}


# ---- balance, from a routing trace -------------------------------------------------------------------------------
def _small_geom(L=6, E=64, K=8) -> Geometry:
    n = L + 1
    return Geometry(layer_types=("dense",) + ("sparse",) * L, experts_per_layer=E, experts_per_token=K,
                    record_bytes=1 << 20, dense_layer_bytes=(4 << 20,) * n, embed_bytes=8 << 20, lm_head_bytes=8 << 20,
                    kv_layer_bytes=(1 << 20,) * n, hidden_size=1024, name="small")


def test_trace_balance_counts_what_the_trace_routes():
    geom = _small_geom()
    idx, _ = glm52(200, 6, n_experts=64, top_k=8, seed=3)
    idx = idx.copy()
    idx[::7, 2, -1] = -1                                         # some dropped slots (expert top-p)
    gpus = [GpuBudget(0, int(2 * GB), 50.0), GpuBudget(1, int(2 * GB), 25.0)]
    for by in ("layer", "expert"):
        p = make_partition(geom, gpus, PartitionOptions(experts_by=by), idx)
        check_plan(p, geom, gpus)
        owner, cost = np.asarray(p.owner), [geom.record_bytes / (50 * GB), geom.record_bytes / (25 * GB)]
        copies, t = np.zeros(2), 0.0
        for tok in range(idx.shape[0]):
            for l in range(6):
                n = [sum(1 for e in idx[tok, l] if e >= 0 and owner[l, e] == g) for g in range(2)]
                copies += n
                t += max(n[g] * cost[g] for g in range(2))
        T = idx.shape[0]
        assert np.allclose([g["copies_per_token"] for g in p.gpus], copies / T, rtol=8 * T * EPS)
        assert math.isclose(p.per_token["copy_s_cold"], t / T, rel_tol=8 * T * 6 * EPS)
        assert math.isclose(p.per_token["routed_experts"], (idx >= 0).sum() / T)
        assert p.routing == f"trace ({T} tokens)"


def test_trace_balance_of_expert_ids_is_within_the_greedy_bound():
    """Each expert goes to the GPU whose load per share is least after taking it, so no GPU ends above
    share x (the layer's total + G x the heaviest expert) — the list-scheduling bound, with +1 per expert."""
    geom = _small_geom()
    idx, _ = glm52(300, 6, n_experts=64, top_k=8, seed=5)
    shares = [0.5, 0.3, 0.2]
    gpus = [GpuBudget(i, int(2 * GB), 100 * s) for i, s in enumerate(shares)]
    owner = assign_experts(geom, gpus, "expert", idx)
    for l in range(6):
        freq = np.bincount(idx[:, l].ravel(), minlength=64) + 1.0
        for g, s in enumerate(shares):
            assert freq[owner[l] == g].sum() <= s * (freq.sum() + 3 * freq.max()) + 1e-9


# ---- hand-offs ---------------------------------------------------------------------------------------------------
def test_handoffs_follow_the_placement(glm5):
    _, _, geom = glm5
    L, E, K = len(geom.moe_layers), geom.experts_per_layer, geom.experts_per_token
    gpus = [GpuBudget(i, int(24 * GB), 55.0) for i in range(3)]
    lay = make_partition(geom, gpus, PartitionOptions(experts_by="layer"))
    assert lay.dense == "split" and lay.handoffs["crossings"] == 2            # one per range boundary
    exp = make_partition(geom, gpus, PartitionOptions(experts_by="expert", dense="whole", peer_access=True))
    home = exp.home[0]
    p_need = [1 - math.comb(E - g["experts_owned"] // L, K) / math.comb(E, K) for g in exp.gpus if g["index"] != home]
    assert math.isclose(exp.handoffs["crossings"], 2 * L * sum(p_need), rel_tol=1e-12)
    assert exp.handoffs["path"] == "peer" and exp.handoffs["bytes"] == exp.handoffs["crossings"] * geom.hidden_size * 4
    host = make_partition(geom, gpus, PartitionOptions(experts_by="expert", dense="whole"))
    assert host.handoffs["path"] == "pinned host" and not host.handoffs["path_known"]
    assert host.handoffs["host_s"] > exp.handoffs["host_s"]


def test_dense_core_splits_when_it_fits_no_single_gpu(glm5):
    _, _, geom = glm5          # 10.63 GB dense + 0.9 GB KV: no 8 GB GPU holds it, three share it
    gpus = [GpuBudget(i, int(8 * GB), 55.0) for i in range(3)]
    p = make_partition(geom, gpus, PartitionOptions(experts_by="expert", dense="auto"))
    assert p.dense == "split" and len(set(p.home)) == 3
    check_plan(p, geom, gpus)
    with pytest.raises(PartitionError, match=r"^GPU 0: its share needs .* budget is 8 GB.*--dense-placement split"):
        make_partition(geom, gpus, PartitionOptions(experts_by="expert", dense="whole"))


# ---- refusals ----------------------------------------------------------------------------------------------------
def test_a_budget_that_cannot_hold_its_share_names_the_gpu(glm5):
    _, _, geom = glm5
    gpus = [GpuBudget(0, int(24 * GB), 55.0), GpuBudget(7, int(3 * GB), 55.0)]
    with pytest.raises(PartitionError, match=r"^GPU 7: its share needs .*layers 40-77.* budget is 3 GB: raise its "
                                             r"--vram-gb"):
        make_partition(geom, gpus, PartitionOptions(experts_by="layer"))
    c = choose(geom, gpus)        # by expert id with the dense core on GPU 0 fits: the choice says why
    assert c.chosen.partition == "expert" and c.chosen.home == [0] * 78 and "GPU 7" in c.why
    with pytest.raises(PartitionError, match=r"by layer: GPU 0: .* \| by expert: GPU 0: "):
        choose(geom, [GpuBudget(0, int(2 * GB), 55.0), GpuBudget(1, int(2 * GB), 55.0)])


def test_bad_inputs_are_refused_with_the_setting_to_change(tiny):
    _, _, geom = tiny
    two = [GpuBudget(0, int(GB), 25.0), GpuBudget(1, int(GB), 25.0)]
    cases = [
        ([GpuBudget(0, int(GB), 25.0), GpuBudget(0, int(GB), 25.0)], {}, None, "GPU 0 is listed twice"),
        ([GpuBudget(i, int(2 * GB), 25.0) for i in range(4)], {"experts_by": "layer"}, None,
         "4 GPUs but the model has 3 MoE layers: partition by expert id"),
        ([GpuBudget(0, int(GB), 25.0), GpuBudget(1, int(GB), None)], {}, None, "GPU 1: its link rate is not known"),
        ([GpuBudget(0, 0, 25.0)], {}, None, "GPU 0: VRAM budget 0 GB must be > 0"),
        (two, {"experts_by": "diagonal"}, None, "--partition must be one of layer, expert"),
        (two, {}, np.zeros((5, 2, 4), np.int32), "want [tokens, 3 MoE layers, top-4]"),
        (two, {}, np.full((5, 3, 4), 16, np.int32), "expert ids outside 0..15"),
        (two, {}, np.zeros((0, 3, 4), np.int32), "no complete token"),
    ]
    for gpus, opts, idx, needle in cases:
        with pytest.raises(PartitionError) as e:
            make_partition(geom, gpus, PartitionOptions(**opts), idx)
        assert needle in str(e.value), (needle, str(e.value))


def test_links_not_known_give_balance_but_no_tokens_per_s(tiny):
    _, _, geom = tiny
    p = make_partition(geom, [GpuBudget(0, int(2 * GB)), GpuBudget(1, int(2 * GB))])
    assert p.tokens_per_s["cold_one_sequence"] is None and p.tokens_per_s["speedup_cold_one_sequence"] > 1
    assert [g["copies_per_token"] for g in p.gpus] == [6.0, 6.0]


# ---- --gpus and per-GPU figures ----------------------------------------------------------------------------------
def test_parse_gpus():
    assert parse_gpus("0,1") == (0, 1) and parse_gpus(" 3 , 1 ") == (3, 1) and parse_gpus("AUTO") == AUTO
    for text, needle in (("0,0", "GPU 0 is listed twice"), ("x", "'x' is not a GPU index"), ("", "--gpus is empty"),
                         ("0,", "'' is not a GPU index"), ("-1", "'-1' is not a GPU index"),
                         ("auto,0", "'auto' stands alone"), ("1.5", "'1.5' is not a GPU index")):
        with pytest.raises(ColiError) as e:
            parse_gpus(text)
        assert needle in str(e.value) and str(e.value).startswith("--gpus"), str(e.value)


def test_resolve_gpus_and_cuda_visible_devices():
    assert resolve_gpus(AUTO, [0, 1, 2]) == (0, 1, 2) and resolve_gpus((2, 0), [0, 1, 2]) == (2, 0)
    assert visible_gpus([0, 1, 2, 3], None) == (0, 1, 2, 3)
    assert visible_gpus([0, 1, 2, 3], "2,0") == (2, 0)
    assert visible_gpus([0, 1, 2, 3], "1,9,2") == (1,)          # the CUDA runtime stops at the first invalid entry
    assert visible_gpus([0, 1], "") == ()
    with pytest.raises(ColiError, match="--gpus auto: no GPU is visible \\(nvidia-smi not found\\)"):
        resolve_gpus(AUTO, [], "nvidia-smi not found")
    with pytest.raises(ColiError, match="--gpus: GPU 3 is not visible \\(visible GPUs: 0, 1\\)"):
        resolve_gpus((0, 3), [0, 1])
    with pytest.raises(ColiError, match="by UUID"):
        visible_gpus([0], "GPU-1234")


def test_per_gpu_values():
    assert per_gpu("16", 3, "--vram-gb") == (16.0,) * 3 and per_gpu("16,24", 2, "--vram-gb") == (16.0, 24.0)
    for text, n, needle in (("16,24,32", 2, "gives 3 values for 2 GPUs"), ("16,lots", 2, "'lots' is not a number"),
                            ("0", 1, "must be > 0"), ("16,-1", 2, "must be > 0"), ("inf", 1, "must be > 0")):
        with pytest.raises(ColiError) as e:
            per_gpu(text, n, "--vram-gb")
        assert needle in str(e.value) and str(e.value).startswith("--vram-gb"), str(e.value)
