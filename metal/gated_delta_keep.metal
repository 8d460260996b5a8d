// Gated delta rule over T tokens that also writes the state after every token.
//
// Body of an mx.fast.metal_kernel, built in mlx_mtp/gated_delta.py. It is
// mlx-lm's gated_delta_step kernel (mlx_lm/models/gated_delta.py) with the
// same thread layout (one SIMD group per (b, hv, dv) state row, Dk/32 floats
// of that row in registers) and one more output, `inter`: after token t each
// lane stores its registers into slot t. Two more changes: loads are cast to
// float explicitly, and the gate/mask variants come from macros the builder
// puts in the header (GDN_KEEP, GDN_G_OFFSET, GDN_G, GDN_G_STEP) instead of
// Python string formatting. gated_delta_keep.cu is the line-for-line twin.

        auto n = thread_position_in_grid.z;
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

        auto dk_idx = thread_position_in_threadgroup.x;
        auto dv_idx = thread_position_in_grid.y;

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
            kv_mem = simd_sum(kv_mem);

            auto delta = (static_cast<float>(v_[dv_idx]) - kv_mem) *
                static_cast<float>(beta_[hv_idx]);

            float out = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
              out += state[i] * static_cast<float>(q_[s_idx]);
            }
            out = simd_sum(out);
            if (thread_index_in_simdgroup == 0) {
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
