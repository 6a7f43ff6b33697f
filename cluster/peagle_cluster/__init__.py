"""Ray Serve application: OpenAI-compatible router, engine replicas, autoscaling, telemetry.

`serve run configs/tiny.yaml` imports `peagle_cluster.app:build_app`.
"""
