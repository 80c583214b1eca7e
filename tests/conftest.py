import os

import jax
import pytest

# The CLI turns JAX's persistent compilation cache on by default; the suite's launches
# (its processes and their children) leave the user's cache alone.
# tests/test_compilation.py turns it on where it is the subject.
os.environ.setdefault("LOWTRAIN_COMPILE_CACHE", "off")

# As in Equinox's own test suite: any silent promotion or broadcasting is a bug.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test twice: the function as it is, and under `eqx.filter_jit`."""
    import equinox as eqx

    return eqx.filter_jit if request.param else (lambda f: f)


# The default suite's budget is 8 minutes on 2 cores (`pytest -n auto`). The tests
# measured slowest there (4 s or more in a loaded run's `--durations=0`, 7 s in an
# unloaded one; the model zoo excepted, whose default cases `tests/test_zoo.py`
# chooses) run in the slow suite, `pytest -m slow`, with those marked in their files.
MEASURED_SLOW = {
    "tests/test_accumulate.py": [
        "test_four_micro_batches_of_8_update_as_one_batch_of_32",
        "test_redo_on_nan_redoes_all_micro_batches",
    ],
    "tests/test_block_precisions.py": [
        "test_an_equinox_mlp_trains_by_name_with_the_cli_precision[mxfp8]",
        "test_an_equinox_mlp_trains_by_name_with_the_cli_precision[fp8_block]",
        "test_value_is_block_dot_general_and_gradients_the_hand_written_vjp[mxfp8]",
        "test_value_is_block_dot_general_and_gradients_the_hand_written_vjp[fp8_block]",
    ],
    "tests/test_amp.py": [
        "test_conv_net[jit-fp16]",
        "test_mlp[jit-fp16]",
        "test_conv_net[eager-bf16]",
        "test_gpt[jit-fp16]",
        "test_mlp[eager-bf16]",
        "test_compose_with_filter_transforms",
        "test_conv_net[eager-fp16]",
        "test_fp8_residuals_are_saved_as_bits",
        "test_gpt[eager-bf16]",
        "test_gpt[eager-fp16]",
        "test_gpt[jit-bf16]",
        "test_mlp[eager-fp16]",
        "test_residuals_half[bf16]",
        "test_residuals_half[fp16]",
        "test_scan_stack[eager-fp16]",
    ],
    "tests/test_amp_equinox.py": [
        "test_vmap_of_amp_is_the_batched_program[bf16]",
        "test_collectives_over_the_vmap_axis_forward_and_backward[fp32]",
        "test_gru_in_scan_the_equinox_way[bf16]",
        "test_gru_in_scan_the_equinox_way[fp16]",
        "test_gru_in_scan_the_equinox_way[fp32]",
        "test_gru_in_scan_the_equinox_way[fp8]",
        "test_vmap_of_amp_inside_scan",
        "test_vmap_of_amp_is_the_batched_program[fp16]",
        "test_vmap_of_amp_is_the_batched_program[fp8]",
        "test_vmap_of_amp_nested_and_under_vmap_of_grad",
    ],
    "tests/test_amp_flax.py": [
        "test_nnx_module_under_amp[fp16]",
        "test_linen_with_batch_stats_and_dropout[bf16]",
        "test_linen_with_batch_stats_and_dropout[fp16]",
        "test_linen_with_batch_stats_and_dropout[fp8]",
        "test_nnx_module_under_amp[bf16]",
        "test_nnx_state_changes_in_place_under_amp[bf16]",
        "test_nnx_state_changes_in_place_under_amp[fp16]",
        "test_nnx_state_changes_in_place_under_amp[fp8]",
        "test_nnx_state_is_kept_by_the_trainer[bf16]",
        "test_nnx_state_is_kept_by_the_trainer[fp16]",
        "test_nnx_state_is_kept_by_the_trainer[fp32]",
        "test_nnx_state_is_kept_by_the_trainer[fp8]",
        "test_nnx_state_resumes_where_it_stopped",
    ],
    "tests/test_architecture.py": [
        "test_architecture_doc_example_runs",
    ],
    "tests/test_attention.py": [
        "test_half_precision_runs_on_the_cpu",
        "test_matches_jax_nn_forward_and_backward[shape1-kw1]",
        "test_half_residuals",
        "test_matches_jax_nn_forward_and_backward[shape0-kw0]",
        "test_matches_jax_nn_forward_and_backward[shape2-kw2]",
        "test_recipe_gpt_fused_attention",
        "test_scalify_traces_xla_attention_where_cudnn_would_run",
    ],
    "tests/test_autopilot.py": [
        "test_a_matmul_that_settles_moves_back_in",
        "test_every_fp8_recipe_precision_runs_its_plan[gpt_unit_fp8-extra3]",
        "test_fit_auto_keeps_the_matmul_whose_gradient_flushes",
        "test_fit_auto_resumes_with_the_plan_in_effect",
        "test_the_cli_runs_the_autopilot",
    ],
    "tests/test_callbacks.py": [
        "test_grain_iterator_position_saved_and_restored",
        "test_partial_batch_that_does_not_divide_over_devices_is_replicated",
    ],
    "tests/test_checkpoint.py": [
        "test_mismatched_or_foreign_checkpoints_are_refused",
        "test_restores_into_another_device_count",
        "test_sigkill_during_save_keeps_previous_checkpoint[sync]",
    ],
    "tests/test_cli_modes.py": [
        "test_loggers_best_checkpoint_sample_and_evaluate",
    ],
    "tests/test_compat.py": [
        "test_backends_initialized_turns_true_at_the_first_device_use",
    ],
    "tests/test_compilation.py": [
        "test_off_writes_nothing_and_reads_nothing",
        "test_second_launch_reads_what_the_first_compiled",
        "test_triton_gemm_flag[--xla_dump_to=/tmp/x-off-True-None-False]",
        "test_triton_gemm_flag[--xla_gpu_enable_triton_gemm=true-off-False-None-True]",
        "test_triton_gemm_flag[-off-True---xla_gpu_enable_triton_gemm=false-False]",
        "test_triton_gemm_flag[-on-True--False]",
    ],
    "tests/test_cross_entropy.py": [
        "test_value_and_gradient_are_the_float32_ones[bfloat16]",
        "test_lean_loss_is_the_recipes_loss_without_float32_logits",
        "test_value_and_gradient_are_the_float32_ones[float32]",
    ],
    "tests/test_distributed.py": [
        "test_two_processes_train_as_one",
    ],
    "tests/test_doc_commands.py": [
        "test_documented_lowtrain_command_composes[python",
        "test_documented_script_commands_parse",
    ],
    "tests/test_docs.py": [
        "test_page_examples_run[docs/guides/numerics.md]",
        "test_page_examples_run[docs/guides/loggers.md]",
        "test_page_examples_run[docs/architecture.md]",
        "test_page_examples_run[docs/guides/amp.md]",
        "test_page_examples_run[docs/guides/equinox_flax.md]",
        "test_page_examples_run[docs/guides/fp8.md]",
        "test_page_examples_run[docs/guides/scalify.md]",
        "test_page_examples_run[docs/guides/trainer.md]",
        "test_page_examples_run[docs/guides/unit_scaling.md]",
        "test_page_examples_run[docs/guides/weights.md]",
        "test_public_docstring_example_runs[lowtrain.amp]",
        "test_public_docstring_example_runs[lowtrain.dot_product_attention]",
        "test_public_docstring_example_runs[lowtrain.fp8.fp8_conv_general_dilated]",
        "test_public_docstring_example_runs[lowtrain.fp8.fp8_dot_general]",
        "test_public_docstring_example_runs[lowtrain.fp8.quantize]",
        "test_public_docstring_example_runs[lowtrain.numerics.plan]",
        "test_public_docstring_example_runs[lowtrain.train.Precision]",
        "test_public_docstring_example_runs[lowtrain.train.async_filter_jit]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.Linear]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.TransformerDecoder]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.TransformerLayer]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.functional.cross_entropy]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.functional.scaled_dot_product_attention]",
        "test_public_docstring_example_runs[lowtrain.unit_scaling.optim.adamw]",
        "test_readme_examples_run",
        "test_site_builds_strict",
    ],
    "tests/test_faults.py": [
        "test_a_runtime_user_error_is_one_line_exit_2_and_no_run_dir[checkpoint]",
        "test_a_full_disk_is_one_sentence_and_leaves_no_partial_save[False]",
        "test_a_mistyped_key_or_option_names_the_close_valid_ones[trainer.stepz=5-`trainer.steps`]",
        "test_a_runtime_user_error_is_one_line_exit_2_and_no_run_dir[data_path]",
        "test_a_config_error_is_one_line_exit_2_and_no_run_dir",
        "test_a_diverged_fp16_run_exits_non_zero",
        "test_a_missing_process_is_an_error_within_the_timeout",
        "test_a_second_cli_launch_on_a_live_run_folder_is_one_line",
        "test_an_infinity_into_an_fp8_cast_is_a_skipped_step",
        "test_damaged_metadata_falls_back_with_the_right_diagnosis[metadata",
        "test_each_refused_resume_names_the_difference",
        "test_kill_9_then_resume_keeps_one_metrics_row_per_step",
        "test_resume_falls_back_to_the_last_checkpoint_that_verifies",
    ],
    "tests/test_finite.py": [
        "test_matches_optax_bit_for_bit",
    ],
    "tests/test_fit.py": [
        "test_one_device_other_than_the_default_trains_there",
    ],
    "tests/test_fp8.py": [
        "test_under_checkpoint_the_saved_fp8_operands_keep_their_values[True]",
        "test_f8_dot_and_its_transposes_are_dot_generals[3]",
        "test_amp_fp8_every_dot_is_fp8[eager-gpt]",
        "test_amp_fp8_every_dot_is_fp8[eager-mlp]",
        "test_amp_fp8_every_dot_is_fp8[jit-gpt]",
        "test_delayed_layer_called_twice_records_the_sum_of_its_amaxes",
        "test_delayed_layer_closed_over_by_scan_records_its_calls",
        "test_delayed_scaling_of_a_vmapped_stack_keeps_one_state_per_layer",
        "test_f8_dot_and_its_transposes_are_dot_generals[2]",
        "test_f8_dot_and_its_transposes_are_dot_generals[4]",
        "test_fp8_conv",
        "test_fp8_dot_batched_einsum_and_grads",
        "test_fp8_sites_take_operands_of_mixed_float_dtypes[1]",
        "test_fp8_sites_take_operands_of_mixed_float_dtypes[2]",
        "test_fp8_sites_take_operands_of_mixed_float_dtypes[3]",
        "test_gpu_lowering_matches_the_dequantized_one[0]",
        "test_gpu_lowering_matches_the_dequantized_one[1]",
        "test_gpu_lowering_matches_the_dequantized_one[2]",
        "test_trainer_keeps_weight_decay_off_delayed_scaling_state",
        "test_under_checkpoint_the_saved_fp8_operands_keep_their_values[False]",
    ],
    "tests/test_fp8_delayed.py": [
        "test_delayed_linears_swap_every_linear_with_a_history_per_layer",
    ],
    "tests/test_fp8_rounding.py": [
        "test_stochastic_rounding_is_unbiased_in_expectation[dtype1]",
        "test_keyless_stochastic_rounding_hashes_each_value_and_its_index",
        "test_stochastic_rounding_is_unbiased_in_expectation[dtype0]",
    ],
    "tests/test_fp8_static.py": [
        "test_static_scale_is_the_plain_cast[f8_dot]",
        "test_simulate_fp8_under_amp_is_the_plain_cast_program",
        "test_static_scale_is_the_plain_cast[dequantized]",
        "test_weights_are_cast_to_fp8_once_per_step_under_grad_accum[gpt_fp8]",
    ],
    "tests/test_loss_scale.py": [
        "test_matches_filter_value_and_grad[jit]",
        "test_matches_filter_value_and_grad[eager]",
    ],
    "tests/test_numerics.py": [
        "test_amp",
        "test_in_place_and_grouped_reads_agree",
        "test_outputs_equal_to_float_rounding",
        "test_rms_and_counts_at_any_magnitude[in",
    ],
    "tests/test_plan.py": [
        "test_casts_report_holds_only_the_casts_each_in_its_format",
        "test_statistics_read_each_tensor_once",
    ],
    "tests/test_precision.py": [
        "test_scalify_exports_plain_values",
    ],
    "tests/test_preemption.py": [
        "test_a_signal_saves_the_step_and_the_resume_matches[15]",
        "test_a_signal_saves_the_step_and_the_resume_matches[2]",
    ],
    "tests/test_recipes.py": [
        "test_precision_residuals_half_saves_compute_dtype_values_only[gpt_fp16]",
        "test_gpt_run_naive_fp8",
        "test_gpt_unit_plain_casts_compose[bf16]",
        "test_gpt_unit_runs[gpt_unit_fp8]",
        "test_mnist_models_under_amp[fp8]",
        "test_mnist_models_under_amp[fp8_naive]",
        "test_mnist_run_writes_every_output",
        "test_naive_fp8_casts_with_scale_one",
        "test_precision_residuals_half_saves_compute_dtype_values_only[gpt_bf16]",
        "test_scalify_fp8_mlp_trains",
    ],
    "tests/test_scalify.py": [
        "test_jax_grad_of_scalify[True]",
        "test_mlp_train_step_under_scalify[fp8]",
        "test_control_flow",
        "test_gpt_train_step_under_scalify[fp8]",
        "test_grad_with_unscaled_cotangent",
        "test_jax_grad_of_scalify[False]",
        "test_mlp_train_step_under_scalify[fp16]",
        "test_rule_matches_float32[1e-9-conv_general_dilated]",
        "test_rule_matches_float32[1e-9-dot_general]",
        "test_rule_matches_float32[1e6-conv_general_dilated]",
        "test_rule_matches_float32[1e6-dot_general]",
    ],
    "tests/test_sharding.py": [
        "test_fsdp_and_grad_accum_on_8_devices_match_replicated",
    ],
    "tests/test_stateful.py": [
        "test_flax_linen_batchnorm_and_dropout_trained_by_the_trainer[fp16]",
        "test_batchnorm_trains_under_every_precision[bf16]",
        "test_amp_composes_with_vmap_axis_name_in_both_orders[vmap_of_amp]",
        "test_batchnorm_trains_under_every_precision[fp16]",
        "test_batchnorm_trains_under_every_precision[fp32]",
        "test_batchnorm_trains_under_every_precision[fp8]",
        "test_eval_uses_running_statistics_and_leaves_state_alone",
        "test_flax_linen_batchnorm_and_dropout_trained_by_the_trainer[bf16]",
        "test_flax_linen_batchnorm_and_dropout_trained_by_the_trainer[fp8]",
        "test_grad_accum_averages_float_state",
        "test_state_checkpointed_and_resumed_exactly",
    ],
    "tests/test_trainer.py": [
        "test_data_parallel_step_matches_one_device",
        "test_numerics_every_records_reports",
        "test_numerics_report_is_of_the_train_step_itself",
        "test_resume_reproduces_uninterrupted_run[async]",
        "test_resume_reproduces_uninterrupted_run[sync]",
        "test_scalify_precision_trains[bfloat16]",
        "test_scalify_precision_trains[float16]",
        "test_stop_on_nonfinite",
    ],
    "tests/test_unit_scale.py": [
        "test_fp8_cast_op_saves_its_operands_as_fp8_bytes",
        "test_mlp_gradients_become_unit_scaled",
        "test_residual_stack_stays_unit",
        "test_simulate_fp8_keep_leaves_the_named_sublayers",
        "test_unit_scale_precision_trains",
        "test_unit_scaling_rescues_plain_fp8",
    ],
    "tests/test_unit_scaling_modules.py": [
        "test_adamw_first_update",
        "test_amp_runs_unit_scaled_matmuls_in_bf16",
        "test_decoder_shapes_loss_and_gradients",
        "test_decoder_stream_is_the_unit_scaled_one_up_to_a_factor",
        "test_decoder_trains_with_umup_adamw",
        "test_stack_of_8_transformer_layers_stays_unit",
    ],
    "tests/test_unit_scaling_ops.py": [
        "test_eager_matches_jit[eager]",
        "test_residual_apply_with_stream_scale_is_the_same_layer",
    ],
    "tests/test_unit_scaling_swiglu.py": [
        "test_fp8_sees_the_same_matmuls_and_scopes",
        "test_values_and_gradients_are_the_op_by_op_ones",
    ],
    "tests/test_user_task.py": [
        "test_user_task_stops_early_and_its_best_checkpoint_round_trips",
    ],
    "tests/test_weights.py": [
        "test_load_model_finds_a_corrupt_checkpoint",
        "test_load_model_from_fit_is_the_trained_model_bit_for_bit",
        "test_load_model_with_model_state",
        "test_safetensors_batchnorm_model_and_state",
        "test_safetensors_mixed_dtypes_numpy_leaves_and_keys",
    ],
}
_SLOW_IDS = {f"{f}::{name}" for f, names in MEASURED_SLOW.items() for name in names}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in _SLOW_IDS:
            item.add_marker(pytest.mark.slow)
