// Mamba2 SSM recurrence over T tokens that also writes the state after each.
//
// Body of an mx.fast.metal_kernel, built in mlx_mtp/ssm_keep.py. It is
// mlx-lm's one-token ssm kernel (make_ssm_kernel in mlx_lm/models/ssm.py)
// with the same thread layout (one SIMD group per (b, h, d) state row, Ds/32
// floats of that row per lane) and the same arithmetic per token, plus:
// a loop over the T tokens that keeps the row in registers, and one more
// output, `inter`, where after token t each lane stores its registers into
// slot t. Inputs are indexed per token ([b, T, ...] instead of [b, 1, ...]),
// loads are cast to float explicitly, and the template names the input and
// state types InT/StT (T is the token count). ssm_keep.cu is the line-for-line
// CUDA twin.

        auto n = thread_position_in_grid.z;
        auto b_idx = n / H;
        auto h_idx = n % H;
        auto g_idx = h_idx / G;
        constexpr int n_per_t = Ds / 32;
        constexpr int n_groups = H / G;

        auto ds_idx = thread_position_in_threadgroup.x;
        auto d_idx = thread_position_in_grid.y;

        // state_in, state_out: [b, H, Dh, Ds]
        auto i_state = state_in + (n * Dh + d_idx) * Ds;
        auto o_state = state_out + (n * Dh + d_idx) * Ds;

        // inter: [b, T, H, Dh, Ds], slot t holds the state after token t
        auto o_inter = inter + ((b_idx * T * H + h_idx) * Dh + d_idx) * Ds;

        auto A = -fast::exp(static_cast<float>(A_log[h_idx]));
        auto D_ = static_cast<float>(D[h_idx]);

        float state[n_per_t];
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * ds_idx + i;
          state[i] = static_cast<float>(i_state[s_idx]);
        }

        for (int t = 0; t < T; ++t) {
          auto bt = b_idx * T + t;
          // X, out: [b, T, H, Dh]; dt: [b, T, H]; B, C: [b, T, n_groups, Ds]
          auto dt_ = static_cast<float>(dt[bt * H + h_idx]);
          auto dA = fast::exp(A * dt_);
          auto x_ = static_cast<float>(X[(bt * H + h_idx) * Dh + d_idx]);
          auto B_ = B + (bt * n_groups + g_idx) * Ds;
          auto C_ = C + (bt * n_groups + g_idx) * Ds;

          float acc = 0.0f;
          for (int i = 0; i < n_per_t; ++i) {
            auto s_idx = n_per_t * ds_idx + i;
            auto dB_by_x = x_ * dt_ * static_cast<float>(B_[s_idx]);
            state[i] = dA * state[i] + dB_by_x;
            o_inter[s_idx] = static_cast<StT>(state[i]);
            acc += state[i] * static_cast<float>(C_[s_idx]);
          }
          acc = simd_sum(acc);
          if (thread_index_in_simdgroup == 0) {
            out[(bt * H + h_idx) * Dh + d_idx] = static_cast<InT>(acc + x_ * D_);
          }
          o_inter += H * Dh * Ds;
        }
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * ds_idx + i;
          o_state[s_idx] = static_cast<StT>(state[i]);
        }
