"""Real 2-process CPU runs (gloo) under Lightning's ModelParallelStrategy: FSDP2 and tensor parallel.

Every callback alone and all four together on the 3-block MLP of sharded_script.py, whose block 1 writes a NaN on
rank 1 only at step 3 (also under manual optimization); all four on the zoo's Hugging Face Llama (also with float8
GEMMs and fp8_all_gather) and on the example ViT (each block and the root fully_shard'ed); checkpoints through the
strategy (distributed and full) and a resumed run.
"""

import json
import math
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "sharded_script.py")
FSDP_RUNS = ["plain", "nan-skip", "nan-skip-manual", "nan-skip-device", "nan-raise", "nan-shard", "precision", "auto",
             "auto-fp8", "nan-skip-fp8", "nan-skip-fp8-gather", "nan-raise-fp8-gather", "nan-skip-fp8-gather-manual",
             "nan-skip-fp8-gather-compile", "nan-skip-auto-fp8-gather", "profiler", "profiler-fp8",
             "profiler-fp8-gather", "compile", "compile-whole", "all4", "all4-mixed", "resume-dcp", "resume-full"]
ZOO_RUNS = ["plain", "all4", "all4-fp8-gather", "all5", "all5-fp8-gather"]
TP_RUNS = ["plain", "nan-skip", "auto", "all4", "all5"]
POISON = [3, "forward", "blocks.1.poison", 1, "data_or_model"]  # step, phase, module, rank, cause


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's fits, run once for the module: {layout: {name: [rank 0's result, rank 1's]}}."""
    results = {}
    for layout, names in (("fsdp", FSDP_RUNS), ("tp", TP_RUNS), ("zoo:hf_llama", ZOO_RUNS),
                          ("vit", ["plain", "all4"])):
        out = tmp_path_factory.mktemp(layout.replace(":", "_"))
        proc = subprocess.run([sys.executable, SCRIPT, str(out), layout, ",".join(names)], capture_output=True,
                              text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
        if proc.returncode != 0:
            pytest.fail(f"{layout}: exit code {proc.returncode}\n{proc.stderr[-4000:]}")
        results[layout] = {n: [json.loads((out / f"{n}.rank{r}.json").read_text()) for r in (0, 1)] for n in names}
    return results


def _same_full_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert a[key] == b[key], key
        else:  # tensor parallel: the ranks' losses differ in the last bit already without opkit; see the README
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_a_nan_on_one_rank_is_named_alike_and_skipped_on_every_rank(runs, layout):
    r0, r1 = runs[layout]["nan-skip"]
    for r in (r0, r1):
        assert r["outcome"] == "finished"
        assert r["global_step"] == 10
        assert r["events"] == [POISON]  # the same module and rank on both ranks, though only rank 1 saw it
        assert r["skipped"] == 1
        # this rank's parameter shards, optimizer state shards and learning rate are bit-identical over the skip
        assert r["changed_at_bad_step"] == []
        assert r["hooks_left"] == runs[layout]["plain"][0]["hooks_left"]  # only the strategy's own hooks remain
    _same_full_weights(r0["weights"], r1["weights"], exact=layout == "fsdp")
    assert 1234.5 not in [v for w in r0["weights"].values() for v in w]  # no NaN reached the weights


def test_the_device_decision_under_fsdp2_skips_as_the_host_does(runs):
    # NaNDetector(decide="device"): the fused AdamW leaves the bad step's update out on the device, on every rank
    for device in runs["fsdp"]["nan-skip-device"]:
        assert (device["outcome"], device["global_step"], device["skipped"]) == ("finished", 10, 1)
        assert device["events"] == [POISON]
        assert device["changed_at_bad_step"] == []  # this rank's shards and optimizer state; no LR schedule here
    r0, r1 = runs["fsdp"]["nan-skip-device"]
    _same_full_weights(r0["weights"], r1["weights"])
    assert 1234.5 not in [v for w in r0["weights"].values() for v in w]


def test_raise_raises_on_every_rank_with_the_same_report(runs):
    r0, r1 = runs["fsdp"]["nan-raise"]
    assert r0["outcome"] == r1["outcome"]
    assert r0["outcome"].startswith("raised: Non-finite output at global step 3")
    assert "blocks.1.poison" in r0["outcome"]
    assert r0["events"] == r1["events"] == [POISON]


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_all_four_together(runs, layout):
    r0, r1 = runs[layout]["all4"]
    for rank, r in enumerate((r0, r1)):
        assert r["outcome"] == "finished"
        assert r["events"] == [POISON]
        assert r["changed_at_bad_step"] == []
        # the policy governed the model's ops: GEMMs in bf16, norm and loss in fp32, nothing else lowered by it
        assert {"matmul:bf16", "norm:fp32", "loss:fp32"} <= set(r["census"])
        assert not any(c.startswith(("communication:", "copy:", "other:")) for c in r["census"])
        # one trace per rank per window, the rank in the file name; compiled in place, frames converted
        assert r["traces"] == [f"rank{rank}.7.pt.trace.json.gz", f"rank{rank}.10.pt.trace.json.gz"]
        assert r["compiled"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert r["frames"] > 0
        assert r["compile_error"] is None
        # the strategy's hooks still ran around the compiled blocks (FSDP's unshard, TP's redistribution):
        # compiled in place, the modules keep their hooks, and nothing of opkit's is left
        assert r["hooks_left"] == runs[layout]["plain"][0]["hooks_left"]
    _same_full_weights(r0["weights"], r1["weights"], exact=layout == "fsdp")


def test_all_five_under_tensor_parallel(runs):
    # all4 under TP, every block also checkpointed (recomputed in backward on DTensor activations) and the memory view
    # on: the same fault named and skipped alike, the same weights as without checkpointing, nothing left behind
    all4 = runs["tp"]["all4"]
    r0, r1 = runs["tp"]["all5"]
    for r, same in zip((r0, r1), all4, strict=True):
        assert r["outcome"] == "finished"
        assert r["events"] == same["events"] == [POISON]
        assert r["checkpointed"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert r["saved_cut"] > 0
        assert r["hooks_left"] == runs["tp"]["plain"][0]["hooks_left"]
        _same_full_weights(r["weights"], same["weights"], exact=False)
    _same_full_weights(r0["weights"], r1["weights"], exact=False)


def test_fsdp2_mixed_precision_keeps_the_policy_rules(runs):
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): FSDP all-gathers bf16 parameters; a norm: fp32
    # rule still runs the norms in fp32 (the policy casts their inputs and the bf16 weights for the op).
    for r in runs["fsdp"]["all4-mixed"]:
        assert r["outcome"] == "finished"
        assert r["events"] == [POISON]
        assert "norm:fp32" in r["census"]
        assert "matmul:bf16" in r["census"]
        assert "norm:bf16" not in r["census"]


def test_fp8_gemms_under_fsdp2_train_alike_on_both_ranks(runs):
    # each block fully_shard'ed: FSDP2 gathers a block's weights before its forward, and the float8 forward reads
    # them there; the 8-wide input projection and the 4-class head cannot run in float8 and stay in bf16. Rank 1's
    # NaN at step 3 is named on both ranks (data_or_model: the fp32 replay has it too) and skipped.
    r0, r1 = runs["fsdp"]["nan-skip-fp8"]
    for r in (r0, r1):
        assert r["outcome"] == "finished"
        assert r["global_step"] == 10
        assert r["fp8"] == [[f"blocks.{i}.{fc}" for i in range(3) for fc in ("fc1", "fc2")], ["head", "inp"]]
        assert {"matmul:fp8", "matmul:bf16"} <= set(r["census"])
        assert r["events"] == [POISON]
        assert r["skipped"] == 1
        assert r["hooks_left"] == runs["fsdp"]["plain"][0]["hooks_left"]
    _same_full_weights(r0["weights"], r1["weights"])
    assert 1234.5 not in [v for w in r0["weights"].values() for v in w]  # no NaN reached the weights
    # float8 GEMMs did run: other weights than the same skip in fp32
    assert r0["weights"] != runs["fsdp"]["nan-skip"][0]["weights"]


def test_fp8_all_gather_gathers_float8_weights_and_trains_as_the_float8_gemms_do(runs):
    # fp8_all_gather=True: each block's float8 Linears have their weight shards cast to float8 before FSDP2 gathers
    # them (a quarter of fp32's bytes); the GEMM receives the weight already in float8. The amax all-reduce gives
    # every shard the whole weight's scale, so the run is the float8 run without it, bit for bit: same losses, same
    # weights, the same NaN named (its fp32 replay runs the gathered weight back in fp32) and skipped.
    import torch

    fc = [f"blocks.{i}.{n}" for i in range(3) for n in ("fc1", "fc2")]
    base = runs["fsdp"]["nan-skip-fp8"]
    for r, b in zip(runs["fsdp"]["nan-skip-fp8-gather"], base):
        assert (r["outcome"], r["global_step"], r["events"], r["skipped"]) == ("finished", 10, [POISON], 1)
        gather = r["gather"]
        assert gather["gathered"] == fc
        assert gather["seen"] == ["Float8TrainingTensor"]
        assert gather["mid_fit_state"] == ["Tensor"]  # the state dict hands out the plain shards
        # each optimizer step drops the scales precomputed at its batch's start (the weights changed); only the
        # skipped step (counted at its end as step 4) stepped nothing and keeps them
        assert gather["scale_kept"] == [POISON[0] + 1]
        # teardown: plain shards, no state-dict hook, and FSDP2 gathers the plain weight again
        assert (gather["after"], gather["after_forward"], gather["state_dict_hooks"]) == (["Tensor"], ["Tensor"], 0)
        assert gather["optimizer_hooks"] == 0
        assert r["hooks_left"] == b["hooks_left"]
        assert r["losses"] == b["losses"]
        assert r["weights"] == b["weights"]
    # the full checkpoint written at step 5 holds plain tensors: it loads into a model without torchao's types
    state = torch.load(runs["fsdp"]["nan-skip-fp8-gather"][0]["gather"]["ckpt"], weights_only=True)["state_dict"]
    assert state.keys() == base[0]["weights"].keys()
    assert {type(v) for v in state.values()} == {torch.Tensor}
    assert all(state[k].numel() == len(base[0]["weights"][k]) for k in state)


def test_after_an_exception_fp8_all_gather_leaves_the_model_and_optimizer_as_they_were(runs):
    # action="raise": the fit ends in NonFiniteError at step 3 on both ranks; the plain shards are back, no state-dict
    # or optimizer hook is left, and FSDP2 gathers the plain weight again, as after a fit that finished
    finished = runs["fsdp"]["nan-skip-fp8-gather"]
    for r, f in zip(runs["fsdp"]["nan-raise-fp8-gather"], finished, strict=True):
        assert r["outcome"].startswith("raised: Non-finite output at global step 3")
        gather = r["gather"]
        assert gather["seen"] == ["Float8TrainingTensor"]
        assert (gather["after"], gather["after_forward"], gather["state_dict_hooks"]) == (["Tensor"], ["Tensor"], 0)
        assert gather["optimizer_hooks"] == 0
        assert r["hooks_left"] == f["hooks_left"]


def test_fp8_all_gather_under_regional_compile_computes_what_eager_does(runs):
    # each block compiled (backend "eager": dynamo's graphs, no kernel of inductor's) receives the float8 weight FSDP2
    # gathered, and the run is the eager run's to the last bit: same NaN named and skipped, same losses and weights
    eager = runs["fsdp"]["nan-skip-fp8-gather"]
    for r, e in zip(runs["fsdp"]["nan-skip-fp8-gather-compile"], eager, strict=True):
        assert (r["outcome"], r["global_step"], r["events"], r["skipped"]) == ("finished", 10, [POISON], 1)
        assert (r["compiled"], r["compile_error"]) == (["blocks.0", "blocks.1", "blocks.2"], None)
        assert r["frames"] > 0
        assert r["gather"]["gathered"] == e["gather"]["gathered"]
        assert r["gather"]["seen"] == ["Float8TrainingTensor"]
        assert (r["gather"]["after"], r["gather"]["state_dict_hooks"]) == (["Tensor"], 0)
        assert r["losses"] == e["losses"]
        assert r["weights"] == e["weights"]


@pytest.mark.parametrize("name", ["nan-skip", "nan-skip-fp8-gather"])
def test_under_manual_optimization_a_nan_is_skipped_as_under_automatic(runs, name):
    # the step zeroes, backpropagates and steps itself (automatic_optimization=False): the same NaN named on both
    # ranks, nothing of the bad step reaches a shard, and the run is the automatic one's to the last bit
    for r, auto in zip(runs["fsdp"][f"{name}-manual"], runs["fsdp"][name], strict=True):
        assert (r["outcome"], r["global_step"], r["events"], r["skipped"]) == ("finished", 10, [POISON], 1)
        assert r["changed_at_bad_step"] == []
        assert r["losses"] == auto["losses"]
        assert r["weights"] == auto["weights"]
        if name.endswith("gather"):  # the GEMMs were handed float8 weights, gathered as under automatic
            assert (r["gather"]["gathered"], r["gather"]["seen"]) == (auto["gather"]["gathered"],
                                                                      ["Float8TrainingTensor"])
            assert r["gather"]["scale_kept"] == auto["gather"]["scale_kept"]  # the user's opt.step() drops them


def test_the_roofline_counts_the_bytes_fp8_all_gather_saves_and_one_all_reduce_sets_every_scale(runs):
    # ProfilerWindows' roofline counts the bytes each collective is handed. float8 GEMMs alone gather what bf16 ones
    # do (FSDP2 gathers the fp32 parameters). With fp8_all_gather each rank hands its shard of a block's fc1 and fc2
    # weights (1,024 elements over 2 ranks: 512) at 1 byte an element instead of 4, and each of the 3 blocks is
    # gathered twice a step (forward, and again for backward: reshard_after_forward=True): 3 * 2 * 512 * 3 bytes
    # less. The six scales come from one all-reduce at the batch's start, not from an amax all-reduce in each of the
    # 12 gathers: 24 bytes, which a CPU's gloo records twice (the functional collective, and gloo's own op on its
    # worker thread); the collective's wait and autograd wrap move nothing and are not counted.
    plain, fp8, gathered = (runs["fsdp"][n] for n in ("profiler", "profiler-fp8", "profiler-fp8-gather"))
    for p, f, g in zip(plain, fp8, gathered, strict=True):
        assert f["fp8"][0] == g["gather"]["gathered"] == [f"blocks.{i}.{n}" for i in range(3) for n in ("fc1", "fc2")]
        assert f["roofline"]["comm_bytes"] == p["roofline"]["comm_bytes"] > 0
        scale_bytes = 3 * 2 * 512 * 3 - (f["roofline"]["comm_bytes"] - g["roofline"]["comm_bytes"])
        assert 24 <= scale_bytes <= 2 * 24  # gloo's worker-thread record is the one a busy machine may lose
        assert "c10d::allreduce_" not in f["collective_calls"]
        assert g["collective_calls"]["c10d::allreduce_"] == 1
        assert g["collective_calls"]["c10d::_allgather_base_"] == f["collective_calls"]["c10d::_allgather_base_"]


def test_auto_measures_as_written_while_fp8_all_gather_holds_overridden_float8_modules(runs):
    # rules="auto", measuring at step 0 and again every 4 steps, while an override keeps each block's fc1 in float8
    # and FSDP2 gathers its weight in float8 from fit start: each measurement (its fp32 baseline and candidates) runs
    # on the weight as written, not on the float8 one dequantized, and every training step after it is handed the
    # float8 weight again. The NaN's replays at step 3 run the step as it ran, float8 weight included.
    for r in runs["fsdp"]["nan-skip-auto-fp8-gather"]:
        assert (r["outcome"], r["global_step"], r["events"], r["skipped"]) == ("finished", 10, [POISON], 1)
        gather = r["gather"]
        assert gather["gathered"] == ["blocks.0.fc1", "blocks.1.fc1", "blocks.2.fc1"]
        assert gather["replayed"] == {"0": ["Tensor"], "3": ["Float8TrainingTensor"], "4": ["Tensor"], "8": ["Tensor"]}
        assert gather["float8_steps"] == list(range(10))
        assert (gather["after"], gather["state_dict_hooks"]) == (["Tensor"], 0)
        assert "matmul:fp8" in r["census"]
    _same_full_weights(*(r["weights"] for r in runs["fsdp"]["nan-skip-auto-fp8-gather"]))


def test_fp8_all_gather_with_all_four_on_the_zoo_llama_under_fsdp2(runs):
    # The zoo's Llama with every callback: the float8 policy gathering its 15 Linears' weights in float8 (the root's
    # lm_head with the root), NaNDetector, ProfilerWindows and regional compile. Its forward fault is named as all4
    # names it, the losses stay within 0.05 of all4's bf16 run, and the checkpoint written mid-fit is plain.
    import torch

    all4 = runs["zoo:hf_llama"]["all4"]
    r0, r1 = runs["zoo:hf_llama"]["all4-fp8-gather"]
    for rank, (r, bf16) in enumerate(zip((r0, r1), all4, strict=True)):
        assert (r["outcome"], r["global_step"], r["skipped"]) == ("finished", 10, 1)
        assert r["events"] == bf16["events"]
        converted, skipped = r["fp8"]
        assert len(converted) == 15
        assert "model.lm_head" in converted
        assert skipped == []
        gather = r["gather"]
        assert (gather["gathered"], gather["skipped"]) == (converted, {})
        assert (gather["seen"], gather["mid_fit_state"]) == (["Float8TrainingTensor"], ["Tensor"])
        assert (gather["after"], gather["after_forward"], gather["state_dict_hooks"]) == (["Tensor"], ["Tensor"], 0)
        assert (r["compiled"], r["compile_error"]) == (bf16["compiled"], None)
        assert r["traces"] == bf16["traces"]
        assert r["hooks_left"] == bf16["hooks_left"]
        finite = {step: loss for step, loss in r["losses"].items() if math.isfinite(loss)}
        assert len(finite) == len(r["losses"]) - rank  # rank 1's faulty step only, skipped
        assert finite == pytest.approx({step: bf16["losses"][step] for step in finite}, abs=0.05)
    _same_full_weights(r0["weights"], r1["weights"])
    state = torch.load(r0["gather"]["ckpt"], weights_only=True)["state_dict"]
    assert state.keys() == r0["weights"].keys()
    assert {type(v) for v in state.values()} == {torch.Tensor}


def test_each_callback_alone_under_fsdp2(runs):
    fsdp = runs["fsdp"]
    for r in fsdp["precision"]:
        assert {"matmul:bf16", "norm:fp32"} <= set(r["census"])
    for rank, r in enumerate(fsdp["profiler"]):
        assert r["traces"] == [f"rank{rank}.7.pt.trace.json.gz", f"rank{rank}.10.pt.trace.json.gz"]
        # FSDP2's all-gathers and reduce-scatters are their own op class, and the window says how much of the step
        # waited for them
        assert r["classes"]["communication"] > 0
        assert r["ops"]["gloo:all_gather"] == "communication"
        assert r["ops"]["FSDP::post_backward_reduce"] == "communication"
        comm, exposed = r["communication"]
        assert 0 < exposed <= comm
        # the roofline on local shards: GEMM FLOPs counted, the collectives' bytes against the measured link
        roofline = r["roofline"]
        assert roofline["link_gbps"] > 0
        assert roofline["matmul_gflops"] > 0
        assert roofline["mfu"] > 0
        assert roofline["comm_bytes"] > 0
        assert "of the measured all_reduce" in roofline["comm_lever"]
    for r in fsdp["compile"]:
        assert r["frames"] > 0
        assert r["compile_error"] is None
    for name in ("precision", "profiler", "compile"):
        assert all(r["outcome"] == "finished" and r["global_step"] == 10 for r in fsdp[name])
        _same_full_weights(fsdp[name][0]["weights"], fsdp[name][1]["weights"])


@pytest.mark.parametrize("kind", ["dcp", "full"])
def test_callback_state_round_trips_the_strategy_checkpoint_and_schedules_resume(runs, kind):
    for rank, (first, resumed) in enumerate(runs["fsdp"][f"resume-{kind}"]):
        assert first["global_step"] == 6
        assert first["events"] == [3]
        assert first["windows"] == 1
        assert resumed["global_step"] == 10
        assert resumed["events"] == [3]  # from the checkpoint: the bad step is behind the resumed run
        assert resumed["skipped"] == 1
        assert resumed["batches"] == 10  # the schedule went on from batch 6, not from 0
        assert resumed["windows"] == 2
        assert resumed["traces"] == [f"rank{rank}.10.pt.trace.json.gz"]


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_auto_measures_in_lockstep_and_every_rank_runs_rank_zeros_choice(runs, layout):
    # Rank 1 measures every 16-bit dtype 10x faster than fp32 (SkewedAuto): ranks that decided for themselves
    # would run different tables; the measurement and candidate runs finish on both ranks (no hang).
    r0, r1 = runs[layout]["auto"]
    for r in (r0, r1):
        assert r["outcome"] == "finished"
        assert r["global_step"] == 10
    assert r0["table"] == r1["table"]
    assert r0["chosen"] == r1["chosen"]
    assert r0["chosen"] is not None
    assert r0["census"] == r1["census"]
    _same_full_weights(r0["weights"], r1["weights"], exact=layout == "fsdp")


def test_auto_measures_each_linear_in_float8_in_lockstep_under_fsdp2(runs):
    # every rank times and replays the same Linears, and runs rank zero's verdicts: the 8-wide input projection and
    # the 4-class head cannot run in float8, the blocks' six Linears are timed (slower on a CPU: none chosen)
    r0, r1 = runs["fsdp"]["auto-fp8"]
    for r in (r0, r1):
        assert r["outcome"] == "finished"
        assert r["global_step"] == 10
    assert r0["fp8_fact"] == r1["fp8_fact"]  # rank zero's figures on both, to the last digit
    assert r0["fp8_fact"][0] == 6
    assert r0["fp8_fact"][1] == []
    assert r0["fp8"] == r1["fp8"] == [[], []]
    assert r0["table"] == r1["table"]
    _same_full_weights(r0["weights"], r1["weights"], exact=True)


def test_whole_forward_compiled_under_fsdp2(runs):
    for r in runs["fsdp"]["compile-whole"]:
        assert r["outcome"] == "finished"
        assert r["compiled"] == [""]
        assert r["frames"] > 0
        assert r["compile_error"] is None
        assert r["hooks_left"] == runs["fsdp"]["plain"][0]["hooks_left"]
    _same_full_weights(*(r["weights"] for r in runs["fsdp"]["compile-whole"]))


@pytest.mark.parametrize("layout,culprit,census,compiled", [
    ("zoo:hf_llama", "model.model.layers.1.mlp.gate_proj", {"matmul:bf16", "attention:bf16", "loss:fp32"},
     ["model.model.layers.0", "model.model.layers.1"]),
    ("vit", "model.blocks.1", {"matmul:bf16", "conv:bf16", "norm:fp32", "softmax:fp32", "loss:fp32"},
     [f"model.blocks.{i}" for i in range(4)]),
])
def test_all_four_on_real_models_under_fsdp2(runs, layout, culprit, census, compiled):
    # The fault: NaN written into the culprit's output by a forward hook, on rank 1 only, at step 3. (The hook runs
    # after the module's forward, so the cause replays, which watch the module's own output, find it finite: the
    # cause is "transient" here, as on one device.)
    r0, r1 = runs[layout]["all4"]
    plain = runs[layout]["plain"][0]
    for rank, r in enumerate((r0, r1)):
        assert r["outcome"] == "finished"
        assert [e[:4] for e in r["events"]] == [[3, "forward", culprit, 1]]
        assert r["changed_at_bad_step"] == []
        assert census <= set(r["census"])
        assert r["traces"] == [f"rank{rank}.7.pt.trace.json.gz", f"rank{rank}.10.pt.trace.json.gz"]
        assert r["compiled"] == compiled
        assert r["frames"] > 0
        assert r["hooks_left"] == plain["hooks_left"]
    assert r0["events"] == r1["events"]
    _same_full_weights(r0["weights"], r1["weights"])


def test_activation_checkpointing_and_the_memory_view_with_all_four_under_fsdp2(runs):
    # The same run as all4 on the zoo's Llama, with every block also checkpointed and the memory view on: the fault
    # is named and skipped alike, and the run computes what all4 computed (the recompute changes no value).
    all4 = runs["zoo:hf_llama"]["all4"]
    r0, r1 = runs["zoo:hf_llama"]["all5"]
    for r, same in zip((r0, r1), all4, strict=True):
        assert r["outcome"] == "finished"
        assert r["events"] == same["events"]
        assert r["checkpointed"] == ["model.model.layers.0", "model.model.layers.1"]
        assert r["saved_cut"] > 0.2
        parameters, gradients, activations = r["memory"]
        assert parameters == r["local_parameter_bytes"]  # this rank's shards, exact
        assert gradients == parameters
        assert activations > 0
        assert r["hooks_left"] == runs["zoo:hf_llama"]["plain"][0]["hooks_left"]
        assert r["losses"] == pytest.approx(same["losses"], rel=1e-5)
    _same_full_weights(r0["weights"], r1["weights"])


def test_activation_checkpointing_of_float8_gemms_gathered_in_float8_under_fsdp2(runs):
    # all5 with the float8 policy and fp8_all_gather: each checkpointed block's recompute runs its float8 GEMMs on the
    # weight FSDP2 gathers again in float8, and the run computes what all4-fp8-gather computed. (The census's fp32
    # reference of a float8 GEMM once saved tensors in the forward that the recompute did not: CheckpointError.)
    # The memory view reads the plain shards inside torchao's wrappers, and the float8 weights saved for backward.
    without = runs["zoo:hf_llama"]["all4-fp8-gather"]
    r0, r1 = runs["zoo:hf_llama"]["all5-fp8-gather"]
    for r, same in zip((r0, r1), without, strict=True):
        assert (r["outcome"], r["events"]) == ("finished", same["events"])
        assert r["checkpointed"] == ["model.model.layers.0", "model.model.layers.1"]
        assert (r["gather"]["gathered"], r["gather"]["seen"]) == (same["gather"]["gathered"], ["Float8TrainingTensor"])
        assert "matmul:fp8" in r["census"]
        assert r["hooks_left"] == same["hooks_left"]
        assert r["losses"] == pytest.approx(same["losses"], rel=1e-5, nan_ok=True)
        # the memory view and the saved-tensor count read the plain shards inside torchao's wrappers (once their
        # storage could not be read: RuntimeError at the first count)
        parameters, gradients, _ = r["memory"]
        assert parameters == gradients == r["local_parameter_bytes"]
        assert r["saved_cut"] > 0.2
    _same_full_weights(r0["weights"], r1["weights"])


def test_a_bad_gradient_shard_no_replay_sees_is_named_from_the_steps_own_shards(runs):
    # A NaN gradient made in the real step's backward only (never in a replay), at block 1 on rank 1: FSDP2 reduces
    # it into every rank's gradient shards, outside autograd, where no replay hook sees it. The step's own shards
    # name the parameter that went bad first in backward, and a rank that holds it; every rank skips alike.
    r0, r1 = runs["fsdp"]["nan-shard"]
    for r in (r0, r1):
        assert r["outcome"] == "finished"
        assert r["events"] == [[3, "backward", "blocks.1.fc2", 0, "unknown"]]
        assert r["parameters"] == ["blocks.1.fc2.bias"]
        assert r["changed_at_bad_step"] == []
    _same_full_weights(r0["weights"], r1["weights"])
