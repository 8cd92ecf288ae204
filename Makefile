# The README's commands. Each installs what is missing, then configures and builds through the presets.
PRESET ?= release
BUILD := build/$(PRESET)

.PHONY: all deps configure build demo test bench clean
all: build

deps:
	@./cmake/install_deps.sh

# CMAKE_ARGS: extra cache settings at the first configure (CI: -DSEQPAR_WARNINGS_AS_ERRORS=ON).
$(BUILD)/build.ninja: CMakeLists.txt CMakePresets.json | deps
	cmake --preset $(PRESET) $(CMAKE_ARGS)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build --preset $(PRESET)

# Only what the demo needs (one example), not the tests, benchmarks and CUDA kernels of `build`.
demo: configure
	cmake --build --preset $(PRESET) --target 00_demo
	./$(BUILD)/examples/00_demo

test: build
	ctest --preset $(PRESET)

bench: build
	./$(BUILD)/bench/attention_cpu --json $(BUILD)/attention_cpu.json
	./$(BUILD)/bench/comm_volume --json $(BUILD)/comm_volume.json
	./$(BUILD)/bench/replay --json $(BUILD)/replay.json --svg-dir $(BUILD)
	./$(BUILD)/bench/plan_scale --json $(BUILD)/plan_scale.json
	./$(BUILD)/bench/calibrate --json $(BUILD)/calibrate.json --profile-out $(BUILD)/this_machine.json

clean:
	rm -rf build
