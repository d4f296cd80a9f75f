"""What a multi-process test module parametrizes over and its worker runs, in one place for both processes
(the test module collects its cases before any worker starts; the worker loops over the same list)."""

# tests/distributed/test_cuda_graphs_dist.py, workers/graphs_worker.py
GRAPHS_SCHEDULES = ("1f1b", "zb-h1", "zbv", "v-half", "dualpipev")
# tests/distributed/test_offload_dist.py, workers/offload_worker.py
OFFLOAD_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "interleaved-1f1b", "dualpipev")
