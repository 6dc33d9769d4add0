"""The Triton kernels (megaopd/ops/_kernels.py) built for an NVIDIA GPU on any machine, no GPU needed: the
specialization Triton's launcher gives them at T=4096, V=152064 (every int argument typed i32 and marked
divisible by 16, as those sizes and their strides are; pointers 16-byte aligned), down to the cubin with the
ptxas triton ships. The compile test (tests/ops/_triton_checks.py) and benchmarks/kernels.py read it.
"""

from __future__ import annotations

import inspect


def signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """{kernel name: {argument: Triton type}} for logits of `dtype` (constexprs left out)."""
    ptr, i32 = f"*{dtype}", "i32"
    sizes = dict(T=i32, V=i32)
    return {
        "stats_kernel": dict(
            p_ptr=ptr, q_ptr=ptr, out_ptr="*fp32", **sizes, stride_p=i32, stride_q=i32, split_size=i32, inv_temp="fp32"
        ),
        "grad_kernel": dict(
            p_ptr=ptr,
            q_ptr=ptr,
            gp_ptr=ptr,
            gq_ptr=ptr,
            tok_ptr="*fp32",
            ids_ptr="*i64",
            **sizes,
            stride_p=i32,
            stride_q=i32,
            stride_gp=i32,
            stride_gq=i32,
            split_size=i32,
            inv_temp="fp32",
            log_a="fp32",
            log_b="fp32",
        ),
        "jsd_kernel": dict(
            p_ptr=ptr,
            q_ptr=ptr,
            tok_ptr="*fp32",
            out_ptr="*fp32",
            **sizes,
            stride_p=i32,
            stride_q=i32,
            split_size=i32,
            inv_temp="fp32",
            log_a="fp32",
            log_b="fp32",
        ),
    }


def build(fn, consts: dict, warps: int, arch: int = 90, dtype: str = "bf16"):
    """triton.compile of kernel `fn` (a _kernels function) with constexprs `consts`; its .asm["ptx"] is the PTX
    and .metadata.shared its shared memory in bytes. Raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = signatures(dtype)[fn.fn.__name__]
    names = list(inspect.signature(fn.fn).parameters)
    div16 = {(names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items() if t.startswith("*") or t == "i32"}
    src = ASTSource(
        fn=fn,
        signature={**sig, **{k: "constexpr" for k in consts}},
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs=div16,
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
