"""`nemo-tlt drafter train`: a first drafter for a user's target, in one command
(nemo_tlt.first_drafter.run). An entry point: it ties the engine, the drafter
trainer and the task sources together."""
