"""The config schema, the experiment's keys, the stages' override sets and the studies."""
