"""Configure time: the engine's training and eval artifacts of the whole model, its pipeline stages and its
tensor-parallel pieces, built once from the graph passes (:mod:`ortflow.configure.configure` is the entry point).

Ranks read the result through :mod:`ortflow.artifacts_folder` only (folder names, records, checksums).
"""
