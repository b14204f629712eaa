"""The environment variables the project sets and reads, each spelled once (launch/slurm.sbatch, a shell
script, spells its own). No imports.
"""

# --- set by the supervisor and its launcher for the worker processes ---------------------------------------
ATTEMPT = "TRAINER_ATTEMPT"  # the attempt's number: restarts use a fresh coordinator port; unset = unsupervised
LAUNCH_ID = "TRAINER_LAUNCH_ID"  # workers put it in their heartbeats: stale files of old attempts never match
STANDBY = "TRAINER_STANDBY"  # "1": a standby worker, waiting on stdin for its attempt (trainer.supervise.standby)
FAILURE = "TRAINER_FAILURE"  # the failure a restarted attempt recovers from: its times (trainer.observe.downtime)
# The explicit process group: the local launcher sets these, and so can a user on any other launcher.
NUM_PROCESSES = "TRAINER_NUM_PROCESSES"
PROCESS_ID = "TRAINER_PROCESS_ID"
COORDINATOR = "TRAINER_COORDINATOR"  # host:port of process 0
COORDINATOR_PORT = "TRAINER_COORDINATOR_PORT"  # under SLURM: the port; the host is the step's first node
# The node a worker says it is on (fast-tier copies go to another node): tests on one machine give each
# process its own ("fake{process}"); unset, SLURM's node name or the host name.
NODE_NAME = "TRAINER_NODE_NAME"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"  # worker output reaches the supervisor line by line
TERMINAL = "TRAINER_TERMINAL"  # "1": the supervisor's stderr is a terminal (the progress line every step)

# --- set for the libraries ---------------------------------------------------------------------------------
XLA_FLAGS = "XLA_FLAGS"  # run.deterministic's and run.xla_latency_hiding's flags (trainer.xla_env); recorded
XLA_PYTHON_CLIENT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # run.gpu_mem_fraction (trainer.xla_env)
JAX_PLATFORMS = "JAX_PLATFORMS"
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"  # Hugging Face tokenizers: one thread per prepare worker

# --- read: SLURM's, for the process group of a job step ----------------------------------------------------
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_PROCID = "SLURM_PROCID"
SLURMD_NODENAME = "SLURMD_NODENAME"  # the node a task runs on
SLURM_CONF = "SLURM_CONF"  # which cluster: the `node` fault finds its own node's slurmd by it
# The job's per-task resources, which the guard step (trainer.supervise.guard) must not inherit.
SLURM_GPUS_PER_TASK = "SLURM_GPUS_PER_TASK"
SLURM_CPUS_PER_TASK = "SLURM_CPUS_PER_TASK"
SRUN_CPUS_PER_TASK = "SRUN_CPUS_PER_TASK"

# --- read: tiktoken's cache folders ------------------------------------------------------------------------
TIKTOKEN_CACHE_DIR = "TIKTOKEN_CACHE_DIR"
DATA_GYM_CACHE_DIR = "DATA_GYM_CACHE_DIR"
