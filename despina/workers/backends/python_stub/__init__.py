"""What runs inside a Python model's own process: the stub and `triton_python_backend_utils`.

The stub is started as a script, so this folder is first on its sys.path and a Triton model's
`import triton_python_backend_utils as pb_utils` finds the module here.
"""
