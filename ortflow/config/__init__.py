"""The run configuration: one frozen pydantic model per section, loaded from YAML.

Field names follow ONNX Runtime's C++ ``TrainingRunner::Parameters`` where one applies
(``num_train_steps``, ``gradient_accumulation_steps``, ``display_loss_steps``, ``checkpoint_period``, ...).

The package is split by concern; everything public is importable from ``ortflow.config``:

* :mod:`.base`: the frozen section base, path resolution, limits and :class:`ConfigError`;
* :mod:`.model_data`, :mod:`.optimizer`, :mod:`.outputs`, :mod:`.distributed`: the sections;
* :mod:`.run`: :class:`RunConfig` and the cross-field rules, checked when it is built;
* :mod:`.loading`: YAML 1.2 loading, ``--set`` overrides, the resolved config of a run folder;
* :mod:`.files`: checks that need the disk (the model file), and :func:`find_problems`, which runs every check and
  returns every problem at once for ``ortflow validate``;
* :mod:`.reference`: the generated field table of docs/config.md;
* :mod:`.batch`: how a global batch splits over ranks (the launcher and every rank read it).

This package imports nothing else from ortflow.
"""

from ortflow.config.base import (  # noqa: F401
    MAX_COUNT,
    MAX_IR_VERSION,
    MAX_OPSET,
    RESOLVED_CONFIG_NAME,
    ConfigError,
    LossName,
    Section,
    regular_file_problem,
    resolve_path,
)
from ortflow.config.batch import (  # noqa: F401
    BatchPlan,
    LayoutError,
    RunFacts,
    divides,
    eval_batch,
    fixed_batch_dim,
    fixed_batch_problems,
    nearest_multiples,
    plan_batch,
    rank_config,
    run_facts,
)
from ortflow.config.clusters import KubernetesConfig, SlurmConfig, Toleration  # noqa: F401
from ortflow.config.distributed import DistributedConfig  # noqa: F401
from ortflow.config.files import (  # noqa: F401
    MAX_MODEL_BYTES,
    check_files,
    check_model_file,
    find_problems,
)
from ortflow.config.loading import (  # noqa: F401
    MAX_CONFIG_BYTES,
    DuplicateKeyError,
    apply_overrides,
    config_file_given,
    config_from_dict,
    dump_config,
    load_config,
    load_run_config,
    load_yaml,
    parse_overrides,
    read_config_dict,
    write_resolved_config,
)
from ortflow.config.model_data import (  # noqa: F401
    DataConfig,
    ModelConfig,
    SourceFormat,
    TextConfig,
    TrainConfig,
)
from ortflow.config.optimizer import (  # noqa: F401
    LRScheduleConfig,
    OptimizerConfig,
    ParamGroupConfig,
    PrecisionConfig,
    param_group_index,
    param_group_problems,
)
from ortflow.config.outputs import (  # noqa: F401
    CheckpointConfig,
    ExportConfig,
    PipelineConfig,
    ScheduleConfig,
    TensorBoardConfig,
    VersionsConfig,
)
from ortflow.config.reference import (  # noqa: F401
    reference_markdown,
)
from ortflow.config.run import (  # noqa: F401
    RunConfig,
)
