"""The detector: GPU telemetry, heartbeats and agent reports turned into faults.

``python -m services.detector`` runs the central service; ``python -m services.detector agent
--node NAME`` runs a node agent. Rules are in :mod:`services.detector.rules`.
"""
