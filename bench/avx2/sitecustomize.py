"""Runs the pipeline on an AVX-512 machine as it would run without AVX-512: every Python process started with this
folder first on ``PYTHONPATH`` sees torch report no AVX-512, AVX512-BF16, VNNI or AMX, so the pipeline's ``auto``s
choose float32 and vLLM loads its AVX2 kernels (``vllm/_C_AVX2``); the environment variables below cap torch's,
MKL's and oneDNN's own kernels at AVX2. The clock and caches stay the machine's own: figures from it are an
emulation, named so in docs/benchmarks.md.

    PYTHONPATH=$PWD/bench/avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 make repro
"""
try:
    import torch.cpu
except ImportError:  # a Python without torch (the installers): nothing to hide
    pass
else:
    from types import MappingProxyType

    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
    _capabilities = dict(torch.cpu.get_capabilities())
    _without_avx512 = {k: (False if k.startswith(("avx512", "amx")) else v) for k, v in _capabilities.items()}
    torch.cpu.get_capabilities = lambda: MappingProxyType(_without_avx512)
