"""bitsandbytes' and torchao's quantized formats for tests/plugins/test_quant_formats.cpp, computed
by the wheels of the test venv (scripts/setup.sh --test pins them).

usage: quant_reference.py IN.safetensors OUT.safetensors
  Each input tensor's name says what to do with it:
    bw8.<block>.<id>             quantize_blockwise(x, code=dynamic map (signed), blocksize=block)
                                 -> <name>.codes, .absmax, .deq_f32, .deq_bf16 (dequantize_blockwise)
    bw8u.<block>.<id>            the same on the unsigned dynamic map
    q4.<nf4|fp4>.<dq0|dq1>.<id>  quantize_4bit(x, blocksize=64, quant_type, compress_statistics=dq1)
                                 -> <name>.packed, .absmax, [.nested_absmax, .offset], .deq_f32,
                                    .deq_bf16 (dequantize_4bit)
    ao<8|4>.<s|u>.<id>           torchao's optimizer-state quantizer (scale_tensor, quantize_<bits>bit_with_qmap,
                                 blocks of 256 / 128, signed / unsigned map) -> <name>.codes (4-bit: packed
                                 as its state packs them), .scale
  and always: map.signed, map.unsigned (create_dynamic_map), map4.nf4, map4.fp4, and torchao's
  maps aomap.<8|4>.<s|u>.
"""
import logging
import sys
import warnings

logging.disable(logging.WARNING)  # bitsandbytes logs that optional GPU kernel packages are absent
warnings.filterwarnings("ignore")

import bitsandbytes.functional as F  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
out = {
    "map.signed": F.create_dynamic_map(signed=True),
    "map.unsigned": F.create_dynamic_map(signed=False),
    "map4.nf4": F.get_4bit_type("nf4", device="cpu"),
    "map4.fp4": F.get_4bit_type("fp4", device="cpu"),
}
from torchao.optim import quant_utils, subclass_4bit, subclass_8bit  # noqa: E402

ao_maps = {
    (8, "s"): subclass_8bit.get_qmap_signed(),
    (8, "u"): subclass_8bit.get_qmap_unsigned(),
    (4, "s"): subclass_4bit.get_qmap_signed(),
    (4, "u"): subclass_4bit.get_qmap_unsigned(),
}
for (bits, sign), values in ao_maps.items():
    out[f"aomap.{bits}.{sign}"] = torch.tensor(values, dtype=torch.float32)

for name, x in load_file(src).items():
    kind = name.split(".")
    if kind[0] in ("bw8", "bw8u"):
        block = int(kind[1])
        code = out["map.signed"] if kind[0] == "bw8" else out["map.unsigned"]
        q, state = F.quantize_blockwise(x, code=code, blocksize=block)
        out[name + ".codes"] = q
        out[name + ".absmax"] = state.absmax
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            as_dtype = F.QuantState(absmax=state.absmax, code=code, blocksize=block, dtype=dtype)
            out[name + ".deq_" + tag] = F.dequantize_blockwise(q, quant_state=as_dtype)
    elif kind[0] == "q4":
        packed, state = F.quantize_4bit(x, blocksize=64, quant_type=kind[1], compress_statistics=kind[2] == "dq1")
        out[name + ".packed"] = packed
        out[name + ".absmax"] = state.absmax
        if state.nested:
            out[name + ".nested_absmax"] = state.state2.absmax
            out[name + ".offset"] = state.offset.reshape(())
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            state.dtype = dtype
            out[name + ".deq_" + tag] = F.dequantize_4bit(packed, state)
    elif kind[0] in ("ao8", "ao4"):
        bits = int(kind[0][2])
        qmap = out[f"aomap.{bits}.{kind[1]}"]
        scaled, scale = quant_utils.scale_tensor(x.view(-1), 256 if bits == 8 else 128)
        if bits == 8:
            codes = quant_utils.quantize_8bit_with_qmap(scaled, qmap)
        else:
            codes = quant_utils.quantize_4bit_with_qmap(scaled, qmap)
            codes = (codes[::2] << 4) | codes[1::2]  # as OptimState4bit's copy_ packs them
        out[name + ".codes"] = codes
        out[name + ".scale"] = scale
    else:
        sys.exit(f"quant_reference.py: unknown input '{name}'")
save_file({k: v.contiguous() for k, v in out.items()}, dst)
