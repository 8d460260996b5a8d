"""The kernel source that MLX generates around a custom kernel's body.

A port of the string building in MLX 0.32 (ml-explore/mlx at 846d176, v0.32.1
plus 26 commits, the state of the 0.32 line): ``write_signature``,
``write_template`` and ``make_template_hash`` in
``mlx/backend/common/metal_kernel.cpp`` (``mx.fast.metal_kernel``), and
``build_kernel`` and ``template_arguments_hash`` in
``mlx/backend/cuda/custom_kernel.cpp`` (``mx.fast.cuda_kernel``). Type names:
``get_type_string`` (``mlx/backend/common/compiled.cpp``) and
``dtype_to_cuda_type`` (``mlx/backend/cuda/utils.cpp``). The Python binding
(``python/src/fast.cpp``) turns scalar inputs into 0-d arrays (a Python int is
an int32) and reads template values as bool, then int, then Dtype.

Only MLX's prelude differs: MLX puts its Metal utilities (``metal::utils()``)
or CUDA device headers first; the emulator puts its shim there.
"""

from typing import List, NamedTuple, Sequence, Tuple, Union

import mlx.core as mx

TemplateArg = Union[bool, int, mx.Dtype]

# Inputs with fewer elements are passed in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}
CUDA_TYPES = {**METAL_TYPES, mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}

# Thread-position attributes, in the order MLX appends those the source names.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


def as_array(x) -> mx.array:
    """An input as the binding passes it: a Python scalar becomes a 0-d array."""
    return x if isinstance(x, mx.array) else mx.array(x)


class ArgInfo(NamedTuple):
    """What the generated signature depends on for one input."""

    dtype: mx.Dtype
    ndim: int
    size: int


def shape_infos(source: str, input_names: Sequence[str]) -> List[Tuple[bool, ...]]:
    return [
        tuple(f"{n}_{s}" in source for s in ("shape", "strides", "ndim"))
        for n in input_names
    ]


def metal_attributes(source: str) -> List[str]:
    return [a for a, _ in METAL_ATTRIBUTES if a in source]


def _template_value(arg: TemplateArg, backend: str) -> str:
    if isinstance(arg, bool):  # before int: bool is an int in Python
        return ("1" if arg else "0") if backend == "metal" else ("t" if arg else "f")
    if isinstance(arg, int):
        return str(arg)
    return (METAL_TYPES if backend == "metal" else CUDA_TYPES)[arg]


def write_template(template: Sequence[Tuple[str, TemplateArg]]) -> str:
    return "<" + ", ".join(_template_value(a, "metal") for _, a in template) + ">"


def make_template_hash(template_def: str) -> str:
    out = template_def.replace(", ", "_").replace("<", "_").replace(">", "_")
    return out[:-1]


def metal_kernel_name(name, template, args: Sequence[ArgInfo], output_dtypes) -> str:
    kname = "custom_kernel_" + name
    if template:
        kname += "_" + make_template_hash(write_template(template))
    for a in args:
        kname += "_" + METAL_TYPES[a.dtype]
        if a.ndim == 0:
            kname += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + METAL_TYPES[d]
    return kname


def metal_source(
    name, header, source, input_names, args, output_names, output_dtypes, template
) -> Tuple[str, str]:
    """(kernel name, source) as ``mx.fast.metal_kernel`` generates them."""
    kname = metal_kernel_name(name, template, args, output_dtypes)
    attributes = [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]
    infos = shape_infos(source, input_names)
    out = header
    if template:
        kinds = [
            "bool"
            if isinstance(a, bool)
            else "int"
            if isinstance(a, int)
            else "typename"
            for _, a in template
        ]
        out += "template <"
        out += ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template))
        out += ">\n"
    out += f"[[kernel]] void {kname}(\n"
    index = 0
    for n, a in zip(input_names, args):
        location = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        out += (
            f"  const {location} {METAL_TYPES[a.dtype]}{ref} {n} [[buffer({index})]],\n"
        )
        index += 1
        if a.ndim > 0 and any(infos[input_names.index(n)]):
            raise NotImplementedError(f"{n}_shape/_strides/_ndim are not emulated")
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        out += f"  device {METAL_TYPES[d]}* {n} [[buffer({index})]]"
        last = index >= len(args) + len(output_names) - 1 and not attributes
        out += ") {\n" if last else ",\n"
        index += 1
    out += ",\n".join(attributes) + (") {\n" if attributes else "")
    out += source + "\n}\n"
    if template:
        tdef = kname + write_template(template)
        out += (
            f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
        )
    return kname, out


def cuda_kernel_name(name, template) -> str:
    return (
        "custom_kernel_"
        + name
        + "".join("_" + _template_value(a, "cuda") for _, a in template)
    )


def cuda_source(
    name, header, source, input_names, args, output_names, output_dtypes, template
) -> Tuple[str, str]:
    """(kernel name, source) as ``mx.fast.cuda_kernel`` generates them, less
    MLX's default header (its device utilities and <cooperative_groups.h>)."""
    kname = cuda_kernel_name(name, template)
    infos = shape_infos(source, input_names)
    out = header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    out += f"__global__ void {kname}(\n"
    for n, a in zip(input_names, args):
        out += f"    const {CUDA_TYPES[a.dtype]}* {n},\n"
        if a.ndim > 0 and any(infos[input_names.index(n)]):
            raise NotImplementedError(f"{n}_shape/_strides/_ndim are not emulated")
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        out += f"    {CUDA_TYPES[d]}* {n}"
        out += ") {\n" if i == len(output_names) - 1 else ",\n"
    if template:
        for n, a in template:
            if isinstance(a, bool):
                out += f"  constexpr bool {n} = {'true' if a else 'false'};\n"
            elif isinstance(a, int):
                out += f"  constexpr int {n} = {a};\n"
            else:
                out += f"  using {n} = {CUDA_TYPES[a]};\n"
        out += "\n"
    out += source + "\n}\n\n} // namespace mlx::core::cu\n"
    return kname, out
