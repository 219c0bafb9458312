"""What gateway, workers and control plane all speak: key names, records, model config, errors.

Nothing here imports a web framework or an ML framework.
"""
