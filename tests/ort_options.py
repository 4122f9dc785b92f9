"""ONNX Runtime's documented option names, for checking the ones edit-rt passes (the installed
CPU package exposes no list of them; these are the names its providers parse, as documented).

- CUDA EP: https://onnxruntime.ai/docs/execution-providers/CUDA-ExecutionProvider.html
  ("Configuration Options"), parsed in onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc;
- TensorRT EP: https://onnxruntime.ai/docs/execution-providers/TensorRT-ExecutionProvider.html
  ("Execution Provider Options"), parsed in
  onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_info.cc (ORT >= 1.18, which the
  gpu extra requires; the explicit profiles ``trt_profile_*_shapes`` since 1.14);
- run options: onnxruntime/core/session/onnxruntime_run_options_config_keys.h
  (``kOrtRunOptionsConfigDisableSynchronizeExecutionProviders``, ``kOrtRunOptionsConfigCudaGraphAnnotation``).
"""

CUDA_EP_OPTIONS = frozenset({
    "device_id", "has_user_compute_stream", "user_compute_stream", "gpu_mem_limit", "arena_extend_strategy",
    "cudnn_conv_algo_search", "do_copy_in_default_stream", "gpu_external_alloc", "gpu_external_free",
    "gpu_external_empty_cache", "cudnn_conv_use_max_workspace", "enable_cuda_graph", "cudnn_conv1d_pad_to_nc1d",
    "tunable_op_enable", "tunable_op_tuning_enable", "tunable_op_max_tuning_duration_ms",
    "enable_skip_layer_norm_strict_mode", "prefer_nhwc", "use_ep_level_unified_stream", "use_tf32", "sdpa_kernel",
})

TENSORRT_EP_OPTIONS = frozenset({
    "device_id", "has_user_compute_stream", "user_compute_stream", "trt_max_partition_iterations",
    "trt_min_subgraph_size", "trt_max_workspace_size", "trt_fp16_enable", "trt_bf16_enable", "trt_int8_enable",
    "trt_int8_calibration_table_name", "trt_int8_use_native_calibration_table", "trt_dla_enable", "trt_dla_core",
    "trt_dump_subgraphs", "trt_engine_cache_enable", "trt_engine_cache_path", "trt_engine_cache_prefix",
    "trt_engine_decryption_enable", "trt_engine_decryption_lib_path", "trt_force_sequential_engine_build",
    "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback", "trt_timing_cache_enable",
    "trt_timing_cache_path", "trt_force_timing_cache", "trt_detailed_build_log", "trt_build_heuristics_enable",
    "trt_sparsity_enable", "trt_builder_optimization_level", "trt_auxiliary_streams", "trt_tactic_sources",
    "trt_extra_plugin_lib_paths", "trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes",
    "trt_cuda_graph_enable", "trt_dump_ep_context_model", "trt_ep_context_file_path", "trt_ep_context_embed_mode",
    "trt_weight_stripped_engine_enable", "trt_onnx_model_folder_path", "trt_engine_hw_compatible",
    "trt_op_types_to_exclude",
})

RUN_OPTION_KEYS = frozenset({
    "disable_synchronize_execution_providers",  # kOrtRunOptionsConfigDisableSynchronizeExecutionProviders
    "gpu_graph_id",  # kOrtRunOptionsConfigCudaGraphAnnotation
    "memory.enable_memory_arena_shrinkage",  # kOrtRunOptionsConfigEnableMemoryArenaShrinkage
})

PROVIDERS = {"CUDAExecutionProvider": CUDA_EP_OPTIONS, "TensorrtExecutionProvider": TENSORRT_EP_OPTIONS}
