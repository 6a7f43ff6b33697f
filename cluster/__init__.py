"""Ray Serve application: OpenAI-compatible router, engine replicas, autoscaling, telemetry.

`serve run configs/tiny.yaml` imports `cluster.app:build_app`.
"""
