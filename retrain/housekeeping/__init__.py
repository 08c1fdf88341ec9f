"""A run's housekeeping: its run dir and the claim on it, secrets kept out of what is saved, the
switches that make reruns bit-exact, and how host memory is kept between steps."""
