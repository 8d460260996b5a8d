// CUDA twin of ssm_keep.metal, line for line: body of an mx.fast.cuda_kernel,
// built in mlx_mtp/ssm_keep.py. Only the spelling differs: thread indices,
// expf for fast::exp, ssm_simd_sum (a warp butterfly defined in the header)
// for simd_sum, T read from a one-element array (cuda_kernel passes every
// input as a pointer), and a guard for the rounded-up grid (CUDA launches
// whole blocks where Metal trims the last threadgroup).
// A run on a CUDA GPU therefore checks the logic the Metal kernel shares.

        const int T = n_tokens[0];
        auto n = blockIdx.z * blockDim.z + threadIdx.z;
        auto b_idx = n / H;
        auto h_idx = n % H;
        auto g_idx = h_idx / G;
        constexpr int n_per_t = Ds / 32;
        constexpr int n_groups = H / G;

        auto ds_idx = threadIdx.x;
        auto d_idx = blockIdx.y * blockDim.y + threadIdx.y;
        if (d_idx >= Dh) {
          return; // a whole warp: its 32 lanes share d_idx
        }

        // state_in, state_out: [b, H, Dh, Ds]
        auto i_state = state_in + (n * Dh + d_idx) * Ds;
        auto o_state = state_out + (n * Dh + d_idx) * Ds;

        // inter: [b, T, H, Dh, Ds], slot t holds the state after token t
        auto o_inter = inter + ((b_idx * T * H + h_idx) * Dh + d_idx) * Ds;

        auto A = -expf(static_cast<float>(A_log[h_idx]));
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
          auto dA = expf(A * dt_);
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
          acc = ssm_simd_sum(acc);
          if (threadIdx.x == 0) {
            out[(bt * H + h_idx) * Dh + d_idx] = static_cast<InT>(acc + x_ * D_);
          }
          o_inter += H * Dh * Ds;
        }
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * ds_idx + i;
          o_state[s_idx] = static_cast<StT>(state[i]);
        }
