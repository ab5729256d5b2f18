"""fp4gen code generation: YAML kernel specs -> validated variants -> rendered CUDA + manifest.json.

codegen never imports the runtime package; generated/manifest.json is the only contract between them.
"""
