"""Shared fixtures: tiny random models of the three architectures, built locally, never downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from dofla.models.tiny import TINY_ARCHITECTURES, build_byte_tokenizer, build_tiny_model
from dofla.runtime import keep_freed_memory
from tests.console_logging import dofla_console  # noqa: F401 - autouse: dofla's lines on stdout, as the commands print them

keep_freed_memory()  # the tests run the code as dofla's commands do (dofla.runtime)

# Under pytest-xdist (make test runs one worker per core) each worker, and every subprocess its tests
# start, gets its share of the cores, so workers do not oversubscribe them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: no affinity
THREADS = max(1, min(2, CORES // WORKERS))
torch.set_num_threads(min(THREADS, torch.get_num_threads()))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

# Every test runs offline as far as trackers and tokenizer threads go; the subprocesses the tests
# start inherit this environment. Tests that need the hub offline set their own caches as well.
# Folders under a cache root that are not activation caches: the prepared corpus and the store of the
# teacher's measurements and its KL targets that every run on the same text shares.
SHARED_CACHE_FOLDERS = ("prepared", "teacher_scores", "teacher_logits")


def activation_caches(root: Path) -> list[Path]:
    """The activation caches under a cache root (one folder per cache key)."""
    if not root.exists():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name not in SHARED_CACHE_FOLDERS]


# Metrics a run measures about itself (wall times, peak memory, step times, the startup predictions): they
# differ between two runs of the same settings, so comparisons of results leave them out.
MEASURED_PREFIXES = ("time/", "resources/")


def token_ids(batch: int = 2, length: int = 29, seed: int = 1) -> torch.Tensor:
    """(batch, length) seeded random ids of the tiny models' 256-token vocabulary."""
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_of(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model``'s logits on ``ids`` without a cache or a gradient."""
    with torch.no_grad():
        return model(ids, use_cache=False, **kwargs).logits


def reproducible(metrics: dict) -> dict:
    """``metrics`` less what the run measured about itself (:data:`MEASURED_PREFIXES`)."""
    return {k: v for k, v in metrics.items() if not k.startswith(MEASURED_PREFIXES)}


OFFLINE_ENVIRONMENT = {"WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="session", autouse=True)
def offline_environment():
    before = {key: os.environ.get(key) for key in OFFLINE_ENVIRONMENT}
    for key, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


ROOT = Path(__file__).resolve().parents[1]

# Unit and component tests that are slow by nature, marked ``slow`` here so that ``make test-fast``
# (tests/unit + tests/component, the inner loop) leaves them to ``make test``, which still runs them
# all: by file, the test functions (every parametrisation) and why. tests/unit/test_tiers.py checks
# that every name still exists.
SLOW = {
    # subprocesses: plain transformers, lm-eval's CLI, torch.distributed's gloo processes, three jobs
    # racing for one cache, the studies' command lines
    "tests/component/test_export.py": (
        "test_lm_eval_cli_scores_the_saved_student", "test_plain_transformers_loads_a_gated_student_with_its_gates",
        "test_plain_transformers_loads_the_student_never_the_teacher",
        "test_push_to_hub_uploads_the_exported_student_with_its_card",
        "test_the_saved_tokenizer_loads_without_asking_to_run_remote_code"),
    "tests/component/test_data_parallel.py": ("test_two_gloo_processes_distil_one_process_steps_at_the_same_batch",
                                              "test_two_gloo_processes_stream_one_process_steps_at_the_same_batch"),
    "tests/component/test_cache.py": ("test_concurrent_jobs_build_once",),
    "tests/component/test_teacher_logit_cache.py": ("test_two_jobs_reading_the_same_text_compute_it_once",),
    "tests/component/test_finetune_protocol_resume.py": (
        "test_a_process_killed_inside_the_teachers_grid_resumes_without_redoing_a_trial",
        "test_two_processes_started_together_run_each_trial_of_the_grid_once",
        "test_a_micro_batched_protocol_scores_what_the_whole_batch_scores",
        "test_a_trial_resumes_from_its_checkpoint_and_from_one_in_the_layout_before_the_loop"),
    "tests/component/test_gpucheck.py": ("test_on_the_cpu_every_cell_and_precision_is_checked_at_tiny_shapes",
                                         "test_the_sweeps_add_up_every_cell_and_the_teachers_grid",
                                         "test_the_gpu_tests_run_and_are_skipped_here"),
    "tests/component/test_budget_allocator.py": ("test_a_linear_state_is_measured_after_fitting_its_features",),
    "tests/unit/test_record_fingerprint.py": ("test_a_tree_with_uncommitted_changes_is_marked_with_the_changed_paths",),
    "tests/unit/test_loop.py": ("test_a_run_killed_by_sigkill_resumes_to_the_same_bits",),
    "tests/unit/test_over_runs.py": ("test_the_command_reads_negative_differences_and_refuses_a_percent_level",
                                     "test_the_command_takes_a_second_arm_and_refuses_one_run_in_it"),
    # whole pipeline runs, and the studies that train and compare students
    "tests/component/test_prepared.py": (
        "test_a_run_on_prepared_tokens_equals_the_run_on_text_and_records_the_resolved_count",
        "test_a_run_whose_eval_needs_more_held_out_tokens_than_prepared_is_refused_before_any_model"),
    "tests/unit/test_chunk_tuning.py": ("test_a_run_with_auto_builds_its_student_at_the_measured_chunk",),
    "tests/unit/test_passkey_study.py": (
        "test_every_student_answers_the_same_prompts_and_is_paired_with_its_reference",
        "test_pairs_compare_each_student_with_its_own_control_and_average_over_pairs"),
    "tests/unit/test_paired_heldout.py": ("test_matched_pairs_average_over_pairs_with_an_interval_over_runs",),
    "tests/unit/test_hybrid_losses_study.py": ("test_main_writes_a_table_per_layer",),
    "tests/unit/test_cost_model.py": ("test_a_cell_costs_positive_hours_and_fits_a_big_gpu_at_its_whole_batch",
                                      "test_the_cpu_check_times_the_step_it_predicts"),
    # lm-eval tasks and the per-task fine-tune protocol
    "tests/component/test_finetune_protocol.py": (
        "test_a_task_without_a_training_split_trains_on_the_data_given_for_it",
        "test_the_teachers_grid_search_runs_once_and_every_cell_reuses_it",
        "test_training_data_that_cannot_be_fetched_is_one_sentence"),
    "tests/component/test_downstream.py": ("test_finetune_protocol_end_to_end",
                                           "test_local_tasks_run_on_teacher_and_student",
                                           "test_real_tasks_offline_are_skipped_in_one_sentence"),
    # torch.compile, real-scale activations, memory traces of whole steps
    "tests/component/test_compile.py": ("test_a_compiled_layer_loss_and_its_gradient_equal_the_eager_ones",),
    "tests/component/test_real_scale.py": ("test_every_feature_map_and_loss_stays_finite_and_trains",),
    "tests/component/test_capacity.py": (
        "test_a_batch_of_one_sequence_is_traced_at_micro_batch_1_only",
        "test_a_distill_batch_of_one_sequence_is_sized_whole",
        "test_at_smollm2_size_the_prediction_is_within_ten_percent_of_the_traced_step",
        "test_the_direct_step_peak_extrapolates_from_one_and_two_layers",
        "test_the_distill_stage_is_sized_before_training_and_auto_picks_its_micro_batch",
        "test_the_distill_step_peak_extrapolates_from_one_and_two_layers",
        "test_the_preflight_refuses_a_micro_batch_that_cannot_fit_and_names_one_that_does",
        "test_the_streamed_step_peak_extrapolates_from_one_and_two_layers",
        "test_under_bf16_the_trace_runs_the_teachers_bfloat16_copy_as_the_stream_does"),
    "tests/component/test_logit_chunks.py": ("test_chunked_logits_give_the_whole_kl_and_its_gradient",
                                             "test_chunks_lower_the_traced_memory_per_sequence"),
    "tests/unit/test_attention.py": ("test_gradient_agreement", "test_prf_long_sequence_realistic_norms_is_finite"),
    "tests/unit/test_causal_losses.py": ("test_pieces_hold_less_memory_than_the_plain_forms",),
    "tests/component/test_live.py": (
        "test_the_streamed_step_reads_the_device_once_per_layer_and_logs_in_one_read",
        "test_streamed_training_logs_every_layer_every_log_every_steps_as_its_curve_records"),
    # training until a measured result (a loss lowered, a gate opened, two runs landing together); each
    # file keeps cheaper tests of the same code in the fast tier
    "tests/component/test_gated_student.py": ("test_an_open_gate_decodes_like_the_parallel_forward_and_saves",
                                              "test_distillation_opens_the_gate_and_keeps_it_a_decay"),
    "tests/component/test_linear_scale.py": ("test_a_scaled_student_decodes_like_its_parallel_forward_saves_and_loads",
                                             "test_distillation_trains_the_scale_with_the_features_only"),
    "tests/component/test_distill.py": ("test_a_resumed_run_ends_where_an_uninterrupted_one_does",
                                        "test_distillation_lowers_the_kl_and_changes_only_what_it_trains"),
    "tests/component/test_window_dropout.py": ("test_always_dropping_the_window_trains_the_linear_student",),
    "tests/component/test_finetune.py": ("test_lora_changes_only_attention_projections_and_round_trips",),
    "tests/component/test_precision.py": ("test_a_bf16_layer_training_lands_near_the_fp32_one",),
    "tests/component/test_micro_batching.py": (
        "test_a_layer_trained_in_micro_batches_lands_where_the_full_batch_one_does",
        "test_a_streamed_run_in_micro_batches_lands_where_the_full_batch_one_does"),
    "tests/component/test_softmax_layers.py": (
        "test_the_greedy_choice_measures_each_step_with_the_earlier_layers_kept_exact",
        "test_the_passkey_choice_restores_the_layers_that_lower_the_answer_nll_most"),
    "tests/component/test_stream.py": ("test_streaming_lowers_every_layers_heldout_loss",),
    "tests/component/test_train.py": ("test_training_reduces_heldout_loss_and_attention_error",),
    "tests/unit/test_output_loss.py": ("test_training_with_the_output_loss_lowers_heldout_output_error",),
}
# ...and the heaviest of the rest (seconds each on a 2-core machine): more training steps, reports with
# plots, wandb, the studies' mains, the stages test's later stages (its first ones stay in the fast tier)
SLOW_TOO = {
    "tests/component/test_train.py": ("test_direct_training_moves_only_feature_parameters",
                                      "test_checkpoint_of_other_settings_is_ignored_not_resumed"),
    "tests/component/test_distill.py": ("test_running_out_of_text_ends_early_and_counts_the_tokens",
                                        "test_micro_batches_accumulate_the_full_batch_gradient"),
    "tests/component/test_window_dropout.py": ("test_a_resumed_run_draws_the_same_windows",),
    "tests/component/test_downstream.py": ("test_offline_mmlu_dev_task_builds_and_runs",),
    "tests/component/test_softmax_layers.py": (
        "test_restoration_kl_matches_a_plain_reference_and_ranks_a_broken_layer_first",),
    "tests/component/test_stream.py": ("test_a_checkpoint_written_before_later_trainer_fields_still_resumes",
                                       "test_run_streaming_writes_artifacts_and_reuses_them"),
    "tests/component/test_report.py": ("test_seed_report_shows_means_intervals_and_paired_differences",
                                       "test_seeds_evaluated_differently_still_group_and_each_metric_shows_its_n",
                                       "test_sweep_report_compares_runs_and_flags_code_differences",
                                       "test_a_repeated_seed_is_left_out_and_named"),
    "tests/component/test_tracking.py": ("test_wandb_offline_writes_a_local_run",
                                         "test_wandb_groups_runs_that_differ_only_in_seed_and_types_them_by_policy"),
    "tests/component/test_measured_resources.py": (
        "test_the_preflight_picks_each_tasks_fine_tune_micro_batch_and_refuses_one_that_does_not_fit",),
    "tests/unit/test_paired_heldout.py": ("test_scores_are_kept_per_text_and_weights_and_reused",
                                          "test_sequence_losses_average_to_the_heldout_loss"),
    "tests/component/test_shuffled_data.py": (
        "test_a_shuffled_run_needs_the_whole_split_prepared_and_says_so_before_loading",),
    "tests/unit/test_plots_dof.py": ("test_write_plots_adds_both_for_a_sweep",),
    "tests/unit/test_quality_vs_tokens.py": ("test_main_prints_both_tables_and_writes_both_pngs",),
    "tests/component/test_prepared.py": (
        "test_num_tokens_all_is_one_pass_over_the_prepared_split_less_the_sample_and_distill",),
    "tests/component/test_micro_batching.py": (
        "test_direct_training_in_micro_batches_lands_where_the_full_batch_one_does",),
    "tests/unit/test_dof_spread.py": ("test_averaged_estimate_is_the_mean_of_single_samples_and_moves_less",),
    "tests/component/test_stages_direct.py": (
        "test_eval_and_report", "test_distill_trains_on_fresh_text_writes_a_student_and_reuses_it",
        "test_a_hybrid_does_not_reuse_the_linear_students_softmax_ranking",
        "test_assemble_keeps_the_layers_chosen_by_passkey_recall_and_extends_the_choice",
        "test_assemble_keeps_the_layer_whose_restoration_lowers_the_kl_most",
        "test_a_sliding_window_student_keeps_exact_the_layer_whose_restoration_lowers_the_kl_most"),
}


def pytest_collection_modifyitems(config, items):
    """Tiers: everything in tests/integration (the CLI, launchers, torchrun, the embedded model) and
    the tests in :data:`SLOW` and :data:`SLOW_TOO` are ``slow``; every parametrisation of a test but
    its first is a ``variant`` (the fast tier runs each test once, ``make test`` every variant);
    ``gpu`` tests are skipped where CUDA is not available. Under xdist, the modules that hold slow
    tests go first, each as one group."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    first_seen = set()
    for item in items:
        where = item.path.relative_to(ROOT).as_posix()
        slow = (*SLOW.get(where, ()), *SLOW_TOO.get(where, ()))
        if "integration" in item.path.parts or item.originalname in slow:
            item.add_marker(pytest.mark.slow)
        if getattr(item, "callspec", None) is not None:
            if (where, item.originalname) in first_seen:
                item.add_marker(pytest.mark.variant)
            first_seen.add((where, item.originalname))
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():  # not keywords: a checkout in a folder named gpu
            item.add_marker(no_gpu)
    if WORKERS > 1:
        # under make test's --dist loadgroup: a module with slow tests runs whole on one worker (its
        # module-scoped runs are made once) and goes first, the rest test by test after it, so the
        # workers take the long modules while there is much left to share and finish together
        slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: item.path not in slow_modules)
        for item in items:
            if item.path in slow_modules:
                item.add_marker(pytest.mark.xdist_group(item.path.relative_to(ROOT).as_posix()))


@pytest.fixture(params=TINY_ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return build_tiny_model(arch, seed=0)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()


# Local lm-eval tasks in the same prompt/choice/target fields as lm-eval's piqa.yaml and
# arc_easy.yaml, on JSON files the tests write: the downstream path runs offline for real.
ACC_METRICS = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]
SCHEMAS = {
    "piqa_local": {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
                   "doc_to_choice": "{{[sol1, sol2]}}"},
    "arc_local": {"doc_to_text": "Question: {{question}}\nAnswer:",
                  "doc_to_target": "{{choices.label.index(answerKey)}}",
                  "doc_to_choice": "{{choices.text}}"},
}


def _piqa_doc(i: int) -> dict:
    return {"goal": f"To warm cup {i},", "sol1": "heat it.", "sol2": "freeze it.", "label": i % 2}


def _arc_doc(i: int) -> dict:
    return {"question": f"What is {i} plus one?", "answerKey": "ABCD"[i % 4],
            "choices": {"text": [str(i + 1 + k) for k in range(4)], "label": list("ABCD")}}


def write_local_tasks(root: Path) -> Path:
    """piqa_local and arc_local (train 12 / validation 10 docs each) as lm-eval YAML + JSONL in ``root``."""
    for name, make in (("piqa_local", _piqa_doc), ("arc_local", _arc_doc)):
        files = {}
        for split, n in (("train", 12), ("validation", 10)):
            files[split] = str(root / f"{name}_{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(make(i)) + "\n" for i in range(n)))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
                  "output_type": "multiple_choice", "training_split": "train",
                  "validation_split": "validation", "metric_list": ACC_METRICS, **SCHEMAS[name]}
        if name == "piqa_local":  # one task with a version, which the runs record and the model card shows
            config["metadata"] = {"version": 2.0}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return root
