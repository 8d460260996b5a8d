// The emulator's driver, included after the generated kernel instances.
//
// argv[1] is a manifest of calls, one block per call:
//   call INSTANCE GX GY GZ TX TY TZ N_IN N_OUT
//   in NBYTES PATH                 (N_IN lines)
//   out NBYTES FILL_HEX PATH       (N_OUT lines; FILL_HEX: one element's bytes)
// Every buffer is its own heap allocation of exactly NBYTES, so that
// AddressSanitizer reports a read or write past any of them.
#pragma once

#include <cinttypes>

namespace emu {

inline void* g_in[64];
inline void* g_out[64];

struct Instance {
  void (*body)(Thread&);
};

inline void* read_file(const char* path, size_t n) {
  void* p = std::malloc(n ? n : 1);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(p, 1, n, f) != n) {
    fail("cannot read %s", path);
  }
  std::fclose(f);
  return p;
}

inline void write_file(const char* path, const void* p, size_t n) {
  FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(p, 1, n, f) != n) {
    fail("cannot write %s", path);
  }
  std::fclose(f);
}

inline void* filled(size_t n, const char* hex) {
  unsigned char elem[16];
  size_t k = std::strlen(hex) / 2;
  for (size_t i = 0; i < k; ++i) {
    std::sscanf(hex + 2 * i, "%2hhx", &elem[i]);
  }
  auto* p = static_cast<unsigned char*>(std::malloc(n ? n : 1));
  for (size_t i = 0; i < n; ++i) {
    p[i] = elem[i % k];
  }
  return p;
}

}  // namespace emu

extern const emu::Instance emu_instances[];
extern const int emu_n_instances;

int main(int argc, char** argv) {
  if (argc != 2) {
    emu::fail("usage: %s MANIFEST", argv[0]);
  }
  FILE* m = std::fopen(argv[1], "r");
  if (!m) {
    emu::fail("cannot open %s", argv[1]);
  }
  int inst, n_in, n_out;
  emu::Dim3 grid, tg;
  char path[4096], hex[40];
  size_t nbytes;
  while (std::fscanf(m, " call %d %u %u %u %u %u %u %d %d", &inst, &grid.x,
                     &grid.y, &grid.z, &tg.x, &tg.y, &tg.z, &n_in,
                     &n_out) == 9) {
    if (inst < 0 || inst >= emu_n_instances || n_in > 64 || n_out > 64) {
      emu::fail("bad manifest entry");
    }
    std::vector<size_t> out_bytes;
    std::vector<std::string> out_paths;
    for (int i = 0; i < n_in; ++i) {
      if (std::fscanf(m, " in %zu %4095s", &nbytes, path) != 2) {
        emu::fail("bad manifest input line");
      }
      emu::g_in[i] = emu::read_file(path, nbytes);
    }
    for (int i = 0; i < n_out; ++i) {
      if (std::fscanf(m, " out %zu %39s %4095s", &nbytes, hex, path) != 3) {
        emu::fail("bad manifest output line");
      }
      emu::g_out[i] = emu::filled(nbytes, hex);
      out_bytes.push_back(nbytes);
      out_paths.push_back(path);
    }
    emu::launch(emu_instances[inst].body, grid, tg);
    for (int i = 0; i < n_out; ++i) {
      emu::write_file(out_paths[i].c_str(), emu::g_out[i], out_bytes[i]);
      std::free(emu::g_out[i]);
    }
    for (int i = 0; i < n_in; ++i) {
      std::free(emu::g_in[i]);
    }
  }
  std::fclose(m);
  return 0;
}
