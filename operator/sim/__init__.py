"""The fleet simulator (`kvpilot simulate`): the operator's own autoscaler and policy tuner
driving a discrete-event model of one InferenceEngine's replicas over a trace.

- trace.py: arrivals (built-in generators, multi-turn conversations, CSV/JSONL files)
- profile.py: a replica's step cost and KV pool (roofline defaults, JSON profiles)
- replica.py: one engine replica, at the level of its scheduler steps (pure); cache.py: its prefix cache
- routing.py: `kvpilot router` in front of the replicas (its own picking function)
- hold.py: the router's hold, for requests that arrive while no replica is ready (scale to zero)
- planners.py: the reference scalers sized from the request rate (oracle-reactive, a Dynamo-style
  TTFT planner, an HPA on requests per second)
- strategies.py: how replicas and the scheduling policy are chosen each interval; kvpilot's
  calls autoscaler.decide and tuner.decide_policy, the baselines beside it
- fleet.py: the event loop (arrivals, steps, control intervals, start-up delays)
- report.py: per-strategy figures; plots.py: the PNGs; calibrate.py: a profile from the real engine
- cli.py: `kvpilot simulate`
"""
