# Included right after llama.cpp's `project()` when scripts/setup_model.sh builds llama-cpp-python
# (CMAKE_PROJECT_llama.cpp_INCLUDE). llama-cpp-python forces llama.cpp's `common` library on, but its Python package
# never loads it: `common` and the HTTP library it pulls in were about half of the build's compile time.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
