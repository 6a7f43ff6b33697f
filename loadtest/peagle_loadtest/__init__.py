"""Load tests for the peagle cluster: a Locust user, workloads, concurrency sweeps and reports (docs/loadtest.md).

Nothing here imports locust except `locustfile.py` (importing locust monkey-patches the process with gevent).
"""
