"""Files `retrain init` and `retrain init-plugin` write into a user's project (string.Template `${...}` slots)."""
