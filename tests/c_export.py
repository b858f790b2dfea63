"""The AOT path's C export, checked without a GPU: what a compiled kernel's exported wrapper
takes, in order (the FFI handlers code against that order)."""

import re


def wrapper_arguments(compiled, directory, prefix) -> list[str]:
    """compiled.export_to_c into `directory` (the DSL runtime libraries loaded first); the names of
    the exported wrapper's parameters, after checking that the object file is not empty."""
    from jax_kda._aot.build import load_dsl_runtime

    load_dsl_runtime()
    compiled.export_to_c(str(directory), prefix, prefix)
    assert (directory / f"{prefix}.o").stat().st_size > 0
    header = (directory / f"{prefix}.h").read_text()
    signature = re.search(rf"int32_t cute_dsl_{prefix}_wrapper\(([^)]*)\)", header)
    assert signature, header
    return [p.strip().split()[-1].lstrip("*") for p in signature.group(1).split(",")]
