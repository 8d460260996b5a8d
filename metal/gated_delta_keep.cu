// CUDA twin of gated_delta_keep.metal, line for line: body of an
// mx.fast.cuda_kernel, built in mlx_mtp/gated_delta.py. Only the spelling
// differs: thread indices, gdn_simd_sum (a warp butterfly defined in the
// header) for simd_sum, T read from a one-element array (cuda_kernel passes
// every input as a pointer), and a guard for the rounded-up grid (CUDA
// launches whole blocks where Metal trims the last threadgroup).
// A run on a CUDA GPU therefore checks the logic the Metal kernel shares.

        const int T = n_tokens[0];
        auto n = blockIdx.z * blockDim.z + threadIdx.z;
        auto b_idx = n / Hv;
        auto hv_idx = n % Hv;
        auto hk_idx = hv_idx / (Hv / Hk);
        constexpr int n_per_t = Dk / 32;

        // q, k: [B, T, Hk, Dk]
        auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
        auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;

        // v, y: [B, T, Hv, Dv]
        auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv;
        y += b_idx * T * Hv * Dv + hv_idx * Dv;

        auto dk_idx = threadIdx.x;
        auto dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
        if (dv_idx >= Dv) {
          return; // a whole warp: its 32 lanes share dv_idx
        }

        // state_in, state_out: [B, Hv, Dv, Dk]
        auto i_state = state_in + (n * Dv + dv_idx) * Dk;
        auto o_state = state_out + (n * Dv + dv_idx) * Dk;

        // inter: [B, T, Hv, Dv, Dk], slot t holds the state after token t
        auto o_inter = inter + ((b_idx * T * Hv + hv_idx) * Dv + dv_idx) * Dk;

        float state[n_per_t];
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = static_cast<float>(i_state[s_idx]);
        }

        // g: [B, T, Hv] or [B, T, Hv, Dk]; beta: [B, T, Hv]
        auto g_ = g + GDN_G_OFFSET;
        auto beta_ = beta + b_idx * T * Hv;

        for (int t = 0; t < T; ++t) {
          if (GDN_KEEP(t)) {
            float kv_mem = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] * static_cast<float>(GDN_G);
              kv_mem += state[i] * static_cast<float>(k_[s_idx]);
            }
            kv_mem = gdn_simd_sum(kv_mem);

            auto delta = (static_cast<float>(v_[dv_idx]) - kv_mem) *
                static_cast<float>(beta_[hv_idx]);

            float out = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
              out += state[i] * static_cast<float>(q_[s_idx]);
            }
            out = gdn_simd_sum(out);
            if (threadIdx.x == 0) {
              y[dv_idx] = static_cast<InT>(out);
            }
          } else {
            y[dv_idx] = static_cast<InT>(0);
          }
          // A masked token leaves the state as it was: its slot repeats it.
          for (int i = 0; i < n_per_t; ++i) {
            auto s_idx = n_per_t * dk_idx + i;
            o_inter[s_idx] = static_cast<StT>(state[i]);
          }
          // Increment data pointers to next time step
          q_ += Hk * Dk;
          k_ += Hk * Dk;
          v_ += Hv * Dv;
          y += Hv * Dv;
          o_inter += Hv * Dv * Dk;
          g_ += GDN_G_STEP;
          beta_ += Hv;
        }
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          o_state[s_idx] = static_cast<StT>(state[i]);
        }
