"""trainer.tools.hlo on XLA:GPU's optimized HLO, where matmuls are library calls, not dots: cuBLAS custom calls
count as matmuls with their operand dtypes and FLOPs (loop bodies by their trip count), cuDNN's fused
attention is counted apart, and `inspect`'s vocabulary check finds the LM head's matmuls among them; on
XLA:CPU's, a bf16 dot that the compiler itself upcast to f32 reads bf16, one the program upcast reads f32.
Pure text: no compile, no jax."""

from __future__ import annotations

from trainer.tools import hlo
from trainer.tools.inspect import vocab_matmuls

# Written in the form `compiled.as_text()` prints on a GPU (jax issue #33004's printout, XLA's
# gemm_rewrite and cuDNN fused-attention tests): a tuple result (product, cuBLAS workspace), the
# contracting dims in backend_config's gemm_backend_config, operands with or without their types inline.
# GPT-2 124M's shapes at 4 x 1024 tokens: the LM head forward in bf16 (cuBLASLt), its weight gradient in
# f32 x f32 (legacy cuBLAS), an MLP matmul in f8 (scale operands after lhs and rhs) and the attention
# scores through cuBLAS with a batch dim in a 12-trip layer loop, cuDNN's attention forward and backward,
# and a triangular solve (a cuBLAS call, no matmul).
GEMM = (
    '"gemm_backend_config":{{"selected_algorithm":"-1","alpha_real":1,"beta":0,"dot_dimension_numbers":'
    '{{"lhs_contracting_dimensions":["{lc}"],"rhs_contracting_dimensions":["{rc}"],"lhs_batch_dimensions":[{lb}],'
    '"rhs_batch_dimensions":[{rb}]}},"alpha_imag":0,"precision_config":{{"operand_precision":["DEFAULT","DEFAULT"],'
    '"algorithm":"ALG_UNSET"}},"epilogue":"DEFAULT","lhs_stride":"0","rhs_stride":"0","grad_x":false,'
    '"grad_y":false,"damax_output":false}}'
)
QUEUE = '"operation_queue_id":"0","wait_on_operation_queues":[]'
FMHA = (
    '"cudnn_fmha_backend_config":{"algorithm":{"algo_id":"0","math_type":"TENSOR_OP_MATH","tuning_knobs":'
    '{"17":"1","24":"0"},"is_cudnn_frontend":true,"workspace_size":"0"},"fmha_scale":0.125,"dropout_rate":0,'
    '"mask_type":"CAUSAL"}'
)
HEAD_FWD = GEMM.format(lc=1, rc=0, lb="", rb="")
HEAD_BWD = GEMM.format(lc=0, rc=0, lb="", rb="")
MLP_F8 = GEMM.format(lc=1, rc=1, lb="", rb="")
SCORES = GEMM.format(lc=2, rc=2, lb='"0"', rb='"0"')


def meta(op_name: str) -> str:
    return f'metadata={{op_name="jit(train_step)/jit(main)/{op_name}" source_file="model.py" source_line=311}}'


def gemm(config: str) -> str:
    return f'backend_config={{{QUEUE},{config},"force_earliest_schedule":false}}'


QKV = "bf16[4,12,1024,64]{3,2,1,0}"
LINES = [  # one instruction a line, as XLA prints it
    "HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(bf16[4096,768]{1,0}, "
    "f32[768,50304]{1,0})->(f32[4096,50304]{1,0}, f32[768,50304]{1,0})}, "
    'frontend_attributes={fingerprint_before_lhs="5f1b0c"}',
    "",
    "%fused_convert (param_0.1: f32[768,50304]) -> bf16[768,50304] {",
    "  %param_0.1 = f32[768,50304]{1,0} parameter(0)",
    "  ROOT %convert.3 = bf16[768,50304]{1,0} convert(%param_0.1), " + meta("jvp(GPT)/convert_element_type"),
    "}",
    "",
    "%body (p: (s32[], bf16[48,1024,64])) -> (s32[], bf16[48,1024,64]) {",
    "  %p = (s32[], bf16[48,1024,64]{2,1,0}) parameter(0)",
    "  %q = bf16[48,1024,64]{2,1,0} get-tuple-element(%p), index=1",
    "  %cublas-batch-gemm.1 = (bf16[48,1024,1024]{2,1,0}, s8[4194304]{0}) custom-call(bf16[48,1024,64]{2,1,0} %q, "
    'bf16[48,1024,64]{2,1,0} %q), custom_call_target="__cublas$lt$matmul", '
    + meta("jvp(GPT)/while/body/BLHK,BMHK->BHLM/dot_general")
    + ", "
    + gemm(SCORES),
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  ROOT %t = (s32[], bf16[48,1024,64]{2,1,0}) tuple(%i, %q)",
    "}",
    "",
    "%cond (c: (s32[], bf16[48,1024,64])) -> pred[] {",
    "  ROOT %k = pred[] constant(true)",
    "}",
    "",
    "ENTRY %main.2 (x.1: bf16[4096,768], w.1: f32[768,50304], dlogits.1: f32[4096,50304], x32.1: f32[4096,768], "
    "a8.1: f8e4m3fn[4096,768], b8.1: f8e4m3fn[3072,768], s.1: f32[], q.1: bf16[4,12,1024,64], "
    "o.1: bf16[4,12,1024,64], l.1: f32[4,12,1024], init.1: (s32[], bf16[48,1024,64])) "
    "-> (f32[4096,50304], f32[768,50304]) {",
    '  %x.1 = bf16[4096,768]{1,0} parameter(0), metadata={op_name="x"}',
    '  %w.1 = f32[768,50304]{1,0} parameter(1), metadata={op_name="w"}',
    "  %dlogits.1 = f32[4096,50304]{1,0} parameter(2)",
    "  %x32.1 = f32[4096,768]{1,0} parameter(3)",
    "  %a8.1 = f8e4m3fn[4096,768]{1,0} parameter(4)",
    "  %b8.1 = f8e4m3fn[3072,768]{1,0} parameter(5)",
    "  %s.1 = f32[] parameter(6)",
    f"  %q.1 = {QKV} parameter(7)",
    f"  %o.1 = {QKV} parameter(8)",
    "  %l.1 = f32[4,12,1024]{2,1,0} parameter(9)",
    "  %init.1 = (s32[], bf16[48,1024,64]{2,1,0}) parameter(10)",
    "  %convert_fusion = bf16[768,50304]{1,0} fusion(%w.1), kind=kLoop, calls=%fused_convert, "
    + meta("jvp(GPT)/convert_element_type"),
    "  %cublas-lt-matmul.1 = (f32[4096,50304]{1,0}, s8[33554432]{0}) custom-call(%x.1, %convert_fusion), "
    'custom_call_target="__cublas$lt$matmul", ' + meta("jvp(GPT)/BLD,DV->BLV/dot_general") + ", " + gemm(HEAD_FWD),
    "  %logits = f32[4096,50304]{1,0} get-tuple-element(%cublas-lt-matmul.1), index=0",
    "  %cublas-gemm.2 = (f32[768,50304]{1,0}, s8[4194304]{0}) custom-call(f32[4096,768]{1,0} %x32.1, "
    'f32[4096,50304]{1,0} %dlogits.1), custom_call_target="__cublas$gemm", '
    + meta("transpose(jvp(GPT))/BLD,DV->BLV/dot_general")
    + ", "
    + gemm(HEAD_BWD),
    "  %dw = f32[768,50304]{1,0} get-tuple-element(%cublas-gemm.2), index=0",
    "  %cublas-lt-matmul-f8.3 = (bf16[4096,3072]{1,0}, s8[33554432]{0}) custom-call(%a8.1, %b8.1, %s.1, %s.1), "
    'custom_call_target="__cublas$lt$matmul$f8", ' + meta("jvp(GPT)/mlp/dot_general") + ", " + gemm(MLP_F8),
    "  %fmha = (bf16[4,12,1024,64]{3,1,2,0}, f32[4,12,1024]{2,1,0}, u8[0]{0}) custom-call(%q.1, %q.1, %q.1), "
    f'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{{QKV}, {QKV}, {QKV}}}, '
    "api_version=API_VERSION_STATUS_RETURNING, "
    + meta("jvp(GPT)/dot_product_attention_fwd")
    + f", backend_config={{{QUEUE},{FMHA}}}",
    "  %fmha-bwd = (bf16[4,12,1024,64]{3,1,2,0}, bf16[4,12,1024,64]{3,1,2,0}, bf16[4,12,1024,64]{3,1,2,0}, "
    'u8[0]{0}) custom-call(%q.1, %q.1, %q.1, %l.1, %o.1, %o.1), custom_call_target="__cudnn$fmhaSoftmaxBackward", '
    "api_version=API_VERSION_STATUS_RETURNING, "
    + meta("transpose(jvp(GPT))/dot_product_attention_bwd")
    + f", backend_config={{{QUEUE},{FMHA}}}",
    "  %trsm = f32[768,768]{1,0} custom-call(f32[768,768]{1,0} %x32.1, f32[768,768]{1,0} %x32.1), "
    f'custom_call_target="__cublas$triangularSolve", backend_config={{{QUEUE}}}',
    "  %loop = (s32[], bf16[48,1024,64]{2,1,0}) while(%init.1), condition=%cond, body=%body, "
    'backend_config={"known_trip_count":{"n":"12"}}',
    "  ROOT %out = (f32[4096,50304]{1,0}, f32[768,50304]{1,0}) tuple(%logits, %dw)",
    "}",
]
GPU_HLO = "\n".join(LINES) + "\n"


def test_cublas_custom_calls_count_as_matmuls_with_their_dtypes_and_flops():
    s = hlo.analyze(GPU_HLO)
    by_op = {}
    for mm in s.matmuls:
        by_op.setdefault(mm.op, []).append(mm)
    assert sorted(by_op) == ["__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8"]  # trsm: no matmul
    (scores, head), (grad,), (f8,) = (
        sorted(by_op["__cublas$lt$matmul"], key=lambda m: m.times, reverse=True),
        by_op["__cublas$gemm"],
        by_op["__cublas$lt$matmul$f8"],
    )
    # The head forward: [4096, 768] x [768, 50304] in bf16; its weight gradient contracts the 4096 tokens.
    assert head.operands == (("bf16", (4096, 768)), ("bf16", (768, 50304))) and head.shape == (4096, 50304)
    assert (head.flops, head.times, head.phase) == (2.0 * 4096 * 50304 * 768, 1, "forward")
    assert grad.operand_dtypes == ("f32", "f32") and grad.shape == (768, 50304)
    assert (grad.flops, grad.phase) == (2.0 * 768 * 50304 * 4096, "backward")
    # f8: the scales after lhs and rhs are no operands of the product; rhs contracts its dim 1.
    assert f8.operand_dtypes == ("f8e4m3fn", "f8e4m3fn") and f8.flops == 2.0 * 4096 * 3072 * 768
    # A batch dim stays in the result; the loop body runs 12 times.
    assert (scores.shape, scores.flops, scores.times) == ((48, 1024, 1024), 2.0 * 48 * 1024 * 1024 * 64, 12)
    assert s.matmul_flops == head.flops + grad.flops + f8.flops + 12 * scores.flops
    assert s.matmul_flops_by_dtypes() == {
        "bf16 x bf16": head.flops + 12 * scores.flops,
        "f32 x f32": grad.flops,
        "f8e4m3fn x f8e4m3fn": f8.flops,
    }
    assert s.attention_calls == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}


def test_inspect_lists_the_vocabulary_matmuls_and_says_whether_all_are_bf16():
    s = hlo.analyze(GPU_HLO)
    r = vocab_matmuls(s.matmuls, [50304])
    assert [(m["op"], m["phase"], m["operands"]) for m in r["vocab_matmuls"]] == [
        ("__cublas$lt$matmul", "forward", ["bf16[4096,768]", "bf16[768,50304]"]),
        ("__cublas$gemm", "backward", ["f32[4096,768]", "f32[4096,50304]"]),
    ]
    assert r["vocab_matmuls_bf16"] is False  # the f32 weight gradient
    bf16_only = [m for m in s.matmuls if m.op != "__cublas$gemm"]
    assert vocab_matmuls(bf16_only, [50304])["vocab_matmuls_bf16"] is True
    assert vocab_matmuls(s.matmuls, [12345]) == {"vocab_dims": [12345], "vocab_matmuls": [], "vocab_matmuls_bf16": None}


# XLA:CPU's optimized HLO (jax 0.8, as printed) of `x @ w` in bf16 -> bf16, whose dot it runs in f32 between
# converts of its own (no op metadata), and of `x.astype(f32) @ v` (the program's convert, v f32).
CPU_UPCAST = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(bf16[64,50304]{1,0}, bf16[50304,256]{1,0})->bf16[64,256]{1,0}}

%fused_computation (param_0: f32[64,50304], param_1: f32[50304,256]) -> f32[64,256] {
  %param_0 = f32[64,50304]{1,0} parameter(0)
  %param_1 = f32[50304,256]{1,0} parameter(1)
  ROOT %dot_general.0 = f32[64,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(GPT))/dot_general" stack_frame_id=2}
}

%wrapped_convert_computation (param_0.1: bf16[64,50304]) -> f32[64,50304] {
  %param_0.1 = bf16[64,50304]{1,0} parameter(0)
  ROOT %convert.3 = f32[64,50304]{1,0} convert(%param_0.1)
}

%wrapped_convert_computation.1 (param_0.2: bf16[1,50304,256]) -> f32[50304,256] {
  %param_0.2 = bf16[1,50304,256]{2,1,0} parameter(0)
  %convert.4 = f32[1,50304,256]{2,1,0} convert(%param_0.2)
  ROOT %bitcast.1 = f32[50304,256]{1,0} bitcast(%convert.4)
}

ENTRY %main.1 (x.1: bf16[64,50304], w.1: bf16[1,50304,256], v.1: f32[50304,256]) -> (bf16[64,256], f32[64,256]) {
  %x.1 = bf16[64,50304]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = bf16[1,50304,256]{2,1,0} parameter(1), metadata={op_name="w"}
  %v.1 = f32[50304,256]{1,0} parameter(2), metadata={op_name="v"}
  %wrapped_convert = f32[64,50304]{1,0} fusion(%x.1), kind=kLoop, calls=%wrapped_convert_computation
  %wrapped_convert.1 = f32[50304,256]{1,0} fusion(%w.1), kind=kLoop, calls=%wrapped_convert_computation.1
  %ynn_fusion = f32[64,256]{1,0} fusion(%wrapped_convert, %wrapped_convert.1), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(f)/transpose(jvp(GPT))/dot_general" stack_frame_id=2}, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  %convert.5 = bf16[64,256]{1,0} convert(%ynn_fusion)
  %x32 = f32[64,50304]{1,0} convert(%x.1), metadata={op_name="jit(f)/convert_element_type" stack_frame_id=3}
  %dot.2 = f32[64,256]{1,0} dot(%x32, %v.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(GPT)/dot_general" stack_frame_id=4}
  ROOT %t = (bf16[64,256]{1,0}, f32[64,256]{1,0}) tuple(%convert.5, %dot.2)
}
"""  # noqa: E501 (XLA's lines, verbatim)


def test_a_dot_xla_cpu_upcast_itself_reads_as_the_programs_bf16():
    compiler, program = hlo.analyze(CPU_UPCAST).matmuls
    assert compiler.operand_dtypes == ("f32", "f32") and compiler.program_dtypes == ("bf16", "bf16")
    assert compiler.upcast_by_xla and compiler.phase == "backward"
    # The program's own convert (jax's convert_element_type carries op metadata) is no upcast of XLA's.
    assert program.program_dtypes == ("f32", "f32") and program.phase == "forward"
    r = vocab_matmuls([compiler, program], [50304])
    assert [(m["operands"], m["upcast_by_xla"]) for m in r["vocab_matmuls"]] == [
        (["bf16[64,50304]", "bf16[50304,256]"], True),
        (["f32[64,50304]", "f32[50304,256]"], False),
    ]
    assert r["vocab_matmuls_bf16"] is False and vocab_matmuls([compiler], [50304])["vocab_matmuls_bf16"] is True
