"""backend=tinker: training and sampling on the Tinker remote GPU service (extra `[tinker]`).

config.py is the option schema (imports nothing heavy); backend.py trains through a LoRA training
client; sampler.py is the inference engine over the service's sampling clients; datums.py turns a
TrainBatch into the SDK's Datum objects; calls.py puts every SDK call through the cross-process
concurrency limit (limiter.py) and bounded retries, and turns the SDK's errors into one-line ones.
"""
