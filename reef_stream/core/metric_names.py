"""Metric names, in one place: the stages (``STAGE_*``) and the name of every metric.

A metric is ``(stage, name, value, labels)``, a ``Metric`` event on ``<ns>.metrics``
(written by ``reef_stream.topics.metrics``). Metric names are the constants below, never
strings written inline at the call site, so a dashboard can rely on them. Counters are
emitted as running totals since the process started (``value`` only grows; a restart starts
again at 0, so readers take differences within one ``labels["instance"]``).
"""

from __future__ import annotations

# --------------------------------------------------------------------------- stages

STAGE_INTAKE = "intake"
STAGE_PROCESSOR = "processor"
STAGE_REWARD = "reward"
STAGE_TRAINER = "trainer"
STAGE_EVALUATOR = "evaluator"
STAGE_FOLLOWER = "follower"

# --------------------------------------------------------------------------- every consumer

#: Records not yet read, per partition a stage's consumer holds: the partition's high watermark
#: (as of the consumer's last fetch) minus the consumer's position. Written by the reward
#: workers, the processor, the trainer and the evaluator with their other metrics. Labels:
#: topic, partition.
CONSUMER_LAG = "consumer_lag"
#: Seconds after which an unchanged lag is written again.
LAG_REPEAT_S = 30.0

# --------------------------------------------------------------------------- every process

#: CPU seconds (user + system: ``time.process_time()``) this process has used since it started,
#: a running total, written by the stage loop with the lag and once more at its end
#: (``MetricsWriter.write_process``). Label ``process``: ``<hostname>.<pid>``, so a restarted
#: process is a new series and a reader sums each series' last value (``ops/scorecard.py``).
#: A process that hosts several stages reports its whole CPU under each of them.
PROCESS_CPU_SECONDS = "process_cpu_seconds"      # labels: process

# --------------------------------------------------------------------------- intake

#: A ``RecordProducer``'s records (running totals, label ``topic``): handed to the client or the
#: spool / acknowledged by the broker / failed for good (the handle says why).
INTAKE_SENT = "sent"
INTAKE_ACKNOWLEDGED = "acknowledged"
INTAKE_FAILED = "failed"
#: Records refused before sending, by ``reason``: ``invalid`` (validation or the guard),
#: ``too_large`` (over the topic's max.message.bytes), ``spool_full`` (backpressure timed out).
INTAKE_REJECTED = "rejected"                    # labels: reason
#: Records held in the on-disk spool now (the broker unreachable or the client's queue full).
INTAKE_SPOOLED = "spooled"

# --------------------------------------------------------------------------- recording proxy

#: ``reef intake proxy`` (stage ``intake``, label ``client=proxy``; running totals): choices
#: recorded (handed to its producer), records dropped by ``reason`` (``spool_full``: the one
#: deliberate drop, serving goes on), and choices or responses not recorded by ``reason``
#: (``upstream_error``, ``malformed_response``, ``unfinished_choice``, ``invalid``, ...).
PROXY_RECORDED = "proxy_recorded"
PROXY_DROPPED = "proxy_dropped"                  # labels: reason
PROXY_UNRECORDED = "proxy_unrecorded"            # labels: reason
#: Feedback records ``POST /v1/feedback`` made durable.
PROXY_FEEDBACK = "proxy_feedback"
#: Its tool-calling trajectories (running totals) by ``outcome``: turns ``chained`` onto a held
#: trajectory; trajectories ``split`` (a turn did not extend one), ``expired`` (idle, or past
#: the bound on what is held), ``restored`` from its journal at start (a proxy before it was
#: killed holding them); journal entries ``journal_damaged`` (skipped at start: a write cut
#: short) and writes ``journal_failed`` (the trajectory held in memory only).
PROXY_TRAJECTORIES = "proxy_trajectories"        # labels: outcome
#: Trajectories it holds now, waiting for their next turn.
PROXY_TRAJECTORIES_HELD = "proxy_trajectories_held"

# --------------------------------------------------------------------------- processor

#: Generations that ended in a unit / expired / too stale / invalid (running totals).
PROCESSOR_GENERATIONS = "generations"            # labels: outcome
#: Feedback records by fate: used, ignored, duplicate, late, unused, orphaned.
PROCESSOR_FEEDBACK = "feedback"                  # labels: fate
#: Generations whose policy version is unknown (``Generation.policy_version_known``), by the
#: outcome the schedule's ``unknown_version`` rule gave them (running totals; also counted in
#: ``generations``).
PROCESSOR_UNKNOWN_VERSION_GENERATIONS = "unknown_version_generations"  # labels: outcome
#: Duplicate generations dropped.
PROCESSOR_DUPLICATE_GENERATIONS = "duplicate_generations"
PROCESSOR_UNITS = "units"
PROCESSOR_TRANSACTIONS = "transactions"
#: Transactions aborted (the runtime rewound to its last committed state and offsets).
PROCESSOR_ABORTED_TRANSACTIONS = "aborted_transactions"
#: Input records that did not decode (dead-lettered).
PROCESSOR_INVALID_RECORDS = "invalid_records"
#: Checkpoint events (``<ns>.checkpoints``, read for staleness) that did not decode, read by this
#: process (running total). The evaluator, which consumes that topic as a group, dead-letters
#: them; the processor only counts them.
PROCESSOR_CHECKPOINTS_UNDECODABLE = "checkpoints_undecodable"
#: Units emitted that the newest checkpoint's offsets have not passed (schedule.max_backlog_steps).
PROCESSOR_TRAINER_BACKLOG = "trainer_backlog"
#: Distributions of what the processor joined (``reef_stream.consumers.processor.record_stats``), each written as
#: ``<name>.count``, ``.mean``, ``.std`` and a cumulative ``<name>.bucket`` per upper bound
#: ``le`` (Prometheus' histogram convention; the last bound is ``+Inf``), running totals since
#: the process started, labelled by the generation's ``policy_version`` (``unknown`` where its
#: producer could not tell it):
#: the rewards of used feedback, per feedback ``source``;
PROCESSOR_REWARD = "reward"                      # labels: source, policy_version
#: the completion lengths in tokens of generations that ended in a unit;
PROCESSOR_RESPONSE_TOKENS = "response_tokens"    # labels: policy_version
#: and the fraction of those cut at ``max_tokens`` (finish_reason LENGTH), with its count.
PROCESSOR_TRUNCATION_RATE = "truncation_rate"    # labels: policy_version

# --------------------------------------------------------------------------- trainer

TRAINER_STEPS = "steps"
TRAINER_UNITS_TRAINED = "units_trained"
#: Units skipped because their id was already trained (a re-emitted unit).
TRAINER_UNITS_DUPLICATE = "units_duplicate"
#: Units dropped because their behaviour policy was too far behind.
TRAINER_UNITS_STALE = "units_stale"
#: Units that could not be decoded (dead-lettered).
TRAINER_UNITS_INVALID = "units_invalid"
#: Policy versions between the trainer's weights and a trained sample's behaviour policy,
#: over the step's samples: mean and max.
TRAINER_STALENESS_MEAN = "staleness_mean"
TRAINER_STALENESS_MAX = "staleness_max"
#: The off-policy degree's distribution: trained samples by staleness (running totals since the
#: process started; label ``staleness``, the number of versions, or ``UNKNOWN_STALENESS`` for
#: samples of unknown policy version: ``Sample.policy_version_known`` False, trained under
#: ``schedule.unknown_version`` ``stalest``; they are left out of the mean and max above and of
#: the logprob gaps below, and count as trained samples all the same).
TRAINER_STALENESS_SAMPLES = "staleness_samples"  # labels: staleness
UNKNOWN_STALENESS = "unknown"
#: Where a trained sample's age comes from, in seconds (``Sample.created_at``, the generation's
#: creation; the unit's ``created_at``; the step's wall-clock time, taken once per step).
#: Histograms of trained samples, running totals since the process started, label ``le``: a
#: bucket's upper bound in seconds (``reef_stream.core.histograms.AGE_LABELS``: "0.25" ... "256",
#: "+Inf"). Counts are per bucket, NOT cumulative: a sample counts only in the first bucket whose
#: bound it does not exceed. Samples with an unknown ``created_at`` (0) are not counted.
#: Generation -> the step that trained it (the whole age);
TRAINER_SAMPLE_AGE_SAMPLES = "sample_age_samples"            # labels: le
#: generation -> its unit (waiting for feedback, then the processor);
TRAINER_SAMPLE_TO_UNIT_SAMPLES = "sample_to_unit_samples"    # labels: le
#: unit -> the step (the units topic, then the trainer's queue).
TRAINER_UNIT_TO_TRAIN_SAMPLES = "unit_to_train_samples"      # labels: le
#: Mean age in seconds of the step's samples with a known created_at, per step (also in the
#: Checkpoint event's metrics; absent when no sample has one).
TRAINER_SAMPLE_AGE_MEAN = "sample_age_mean_s"
TRAINER_STEP_SECONDS = "step_seconds"
TRAINER_DATA_SECONDS = "data_seconds"
#: Rollback checkpoints written since the process started (``reef_stream.publishing.rollback``;
#: label ``to_version``, the promoted version whose weights the newest one holds again).
TRAINER_ROLLBACKS = "rollbacks"   # labels: to_version
#: Policy health, per step (``TorchBackend.train_step``; a policy-gradient family's only, but
#: ``update_ratio``). Mean ``|current - behaviour|`` logprob over completion tokens, before the
#: step's first update, of samples generated by the version the trainer holds (inference vs
#: training numerics) and of older ones (staleness), with each bucket's token count. A bucket
#: without tokens is not reported.
TRAINER_LOGPROB_GAP_SAME_VERSION = "logprob_gap.same_version"
TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS = "logprob_gap.same_version_tokens"
TRAINER_LOGPROB_GAP_OLDER = "logprob_gap.older"
TRAINER_LOGPROB_GAP_OLDER_TOKENS = "logprob_gap.older_tokens"
#: The gradient's global norm before clipping (``Backend.max_grad_norm``), mean over a step's
#: updates.
TRAINER_GRAD_NORM = "grad_norm"
#: Optimizer batches of a step with no sample to learn from (dynamic sampling dropped them all,
#: on every rank): no update was made for them. Reported only when there were some.
TRAINER_SKIPPED_UPDATES = "skipped_updates"
#: KL(behaviour || current) per completion token, before the step's first update (k3 estimator).
TRAINER_KL_BEHAVIOUR = "kl_behaviour"
#: ||weights after the step - weights before|| / ||weights before||, over every parameter.
TRAINER_UPDATE_RATIO = "update_ratio"
#: Metrics of the built-in policy-gradient losses (``reef_stream.api.losses``), per step (mean
#: over micro batches), next to ``loss``: the share of loss tokens whose clipped term was chosen
#: (both sides; below ``1 - epsilon`` with a negative advantage; above ``1 + epsilon_high`` with
#: a positive one), the share held by the dual clip, the mean importance ratio, the KL to the
#: reference policy (its estimator's mean over tokens, ``KLPenalty`` on), the policy's entropy
#: per token (``EntropyBonus`` on), the mean behaviour weight over the tokens it weights and the
#: share of loss tokens whose weight was truncated or which it dropped (``DecoupledProximal``
#: on, by its ``weight_mode``, when it has bounds).
LOSS_CLIP_FRACTION = "clip_fraction"
LOSS_CLIP_FRACTION_LOW = "clip_fraction_low"
LOSS_CLIP_FRACTION_HIGH = "clip_fraction_high"
LOSS_DUAL_CLIP_FRACTION = "dual_clip_fraction"
LOSS_RATIO_MEAN = "ratio_mean"
LOSS_KL_REFERENCE = "kl_reference"
LOSS_ENTROPY = "entropy"
LOSS_BEHAVIOUR_WEIGHT_MEAN = "behaviour_weight_mean"
LOSS_BEHAVIOUR_TRUNCATED_FRACTION = "behaviour_truncated_fraction"
LOSS_BEHAVIOUR_MASKED_FRACTION = "behaviour_masked_fraction"
#: An objective's share of the step's groups dropped by dynamic sampling (all rewards equal;
#: reported as ``objective.dynamic_sampling_dropped_fraction``).
OBJECTIVE_DYNAMIC_SAMPLING_DROPPED = "dynamic_sampling_dropped_fraction"

# --------------------------------------------------------------------------- evaluator

#: Publications produced, by decision (running totals).
EVALUATOR_DECISIONS = "decisions"                # labels: decision (PROMOTED, REJECTED)
#: Checkpoint events given no decision: of another recipe or model (why=other), or already
#: decided (why=decided: a re-emitted event, or a version not newer than one decided).
EVALUATOR_CANDIDATES_SKIPPED = "candidates_skipped"  # labels: why
#: Candidates REJECTED without measuring because a newer candidate of their model was waiting
#: (the evaluator's ``supersede``, ``reef_stream.consumers.evaluator.superseding``; running total, also
#: counted in ``decisions``).
EVALUATOR_CANDIDATES_SUPERSEDED = "candidates_superseded"
#: Seconds one try of the evaluator's ``measure`` took.
EVALUATOR_MEASURE_SECONDS = "measure_seconds"
#: Each value of the latest candidate's measurement (e.g. held-out accuracy), and the candidate's
#: policy version, written with each decision. Labels: model, measure (the measurement's key).
EVALUATOR_MEASUREMENT = "measurement"           # labels: model, measure
EVALUATOR_CANDIDATE_VERSION = "candidate_version"  # labels: model, decision

# --------------------------------------------------------------------------- follower

#: A replica's heartbeat: value = the policy version it serves (-1: none yet). Labels: replica,
#: model, host, state (serving, waiting, stopped). ``reef fleet --rebuild`` reads these back.
FOLLOWER_POLICY_VERSION = "policy_version"
#: Versions loaded and handed to the serving code (running total).
FOLLOWER_VERSIONS_LOADED = "versions_loaded"
#: Versions refused: checksum mismatch, unreadable checkpoint, or the callback raised.
FOLLOWER_VERSIONS_REFUSED = "versions_refused"
#: Records of ``<ns>.publications`` that did not decode, read by this replica (running total).
#: The evaluator dead-letters them; replicas only count them.
FOLLOWER_PUBLICATIONS_UNDECODABLE = "publications_undecodable"
#: Seconds from a publication's arrival to the serving code having its weights.
FOLLOWER_LOAD_SECONDS = "load_seconds"
#: Seconds from the checkpoint's creation by the trainer (the publication's
#: ``checkpoint_created_at``) / from the evaluator's decision to this replica serving it.
FOLLOWER_CHECKPOINT_TO_SERVING_SECONDS = "checkpoint_to_serving_seconds"
FOLLOWER_PUBLICATION_TO_SERVING_SECONDS = "publication_to_serving_seconds"

# --------------------------------------------------------------------------- reward

#: A reward worker's counters (``RewardSummary``; running totals, label ``group``): generations
#: taken, feedback sent, calls failed on every try, results not a finite reward, records that did
#: not decode, retries, tries timed out, records dropped on a revoke or at stop.
REWARD_RECORDS = "records"
REWARD_REWARDED = "rewarded"
REWARD_FAILED = "failed"
REWARD_INVALID = "invalid"
REWARD_UNDECODABLE = "undecodable"
REWARD_RETRIED = "retried"
REWARD_TIMED_OUT = "timed_out"
REWARD_DROPPED = "dropped"
#: The mean reward of the feedback sent since the process started, per feedback source.
REWARD_MEAN = "reward_mean"                      # labels: source
#: The reward worker's call slots (``consumers.reward.calls``): slots busy with a call running
#: past the observed p99 (and that count over ``concurrency``: the saturation), the latency of
#: the tries that returned (p50, p99, seconds), and the slow lane (queued + running).
REWARD_SATURATED_SLOTS = "saturated_slots"
REWARD_SATURATION = "saturation"
REWARD_CALL_P50 = "call_seconds_p50"
REWARD_CALL_P99 = "call_seconds_p99"
REWARD_SLOW_LANE = "slow_lane"
#: In-thread tries that timed out and whose threads still run (``RewardOptions.abandoned_limit``);
#: the circuit (``consumers.reward.circuit``): open (1) or closed (0), how many times it opened
#: (a running total), and the generations it holds.
REWARD_ABANDONED = "abandoned_calls"
REWARD_CIRCUIT_OPEN = "circuit_open"
REWARD_CIRCUIT_OPENINGS = "circuit_openings"
REWARD_HELD = "held"
#: The sandbox pool of ``reef reward --sandbox process`` (``reef_stream.consumers.reward.sandbox.pool``): its
#: size and live workers, calls that found a worker idle (warm) or waited for one to start
#: (cold), workers replaced after a kill, worker start and call latency (p50, p99, seconds),
#: whether the calls' network is isolated (1) or not (0), and the calls that ended in each
#: sandbox failure category (label ``category``: timeout, memory, crashed, exit,
#: output_invalid, sandbox_unavailable).
SANDBOX_POOL_SIZE = "sandbox_pool_size"
SANDBOX_LIVE = "sandbox_live"
SANDBOX_WARM_STARTS = "sandbox_warm_starts"
SANDBOX_COLD_STARTS = "sandbox_cold_starts"
SANDBOX_RESTARTS = "sandbox_restarts"
SANDBOX_START_P50 = "sandbox_start_seconds_p50"
SANDBOX_START_P99 = "sandbox_start_seconds_p99"
SANDBOX_CALL_P50 = "sandbox_call_seconds_p50"
SANDBOX_CALL_P99 = "sandbox_call_seconds_p99"
SANDBOX_NETWORK_ISOLATED = "sandbox_network_isolated"
SANDBOX_FAILURES = "sandbox_failures"            # labels: category
