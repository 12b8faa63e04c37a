# libattnclient (C client library) and attnctl (CLI). Included from
# client/CMakeLists.txt, so the binaries land in $BUILD/client/.
add_library(attnd_client STATIC ${CMAKE_CURRENT_SOURCE_DIR}/attnclient.c
                         ${CMAKE_CURRENT_SOURCE_DIR}/attnclient_io.c)
target_include_directories(attnd_client PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(attnd_client PUBLIC attnd_proto)

add_executable(attnctl ${CMAKE_CURRENT_SOURCE_DIR}/attnctl.c ${CMAKE_CURRENT_SOURCE_DIR}/attnctl_out.c
                       ${CMAKE_CURRENT_SOURCE_DIR}/attnctl_cmds.c
                       ${CMAKE_CURRENT_SOURCE_DIR}/attnctl_bench.c)
target_link_libraries(attnctl PRIVATE attnd_client m)
install(TARGETS attnctl RUNTIME DESTINATION bin)
# The C library for other programs: its header includes the generated attnd.pb.h,
# and it links attnd_proto and Debian's nanopb (libnanopb-dev).
install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/attnclient.h ${PROJECT_BINARY_DIR}/proto/attnd.pb.h
        DESTINATION include/attnd)
install(TARGETS attnd_client attnd_proto ARCHIVE DESTINATION lib)
# Head-sharded mode (attnclient_shard.h): part of the same library.
target_sources(attnd_client PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/attnclient_shard.c)
# Same-host zero-copy: RegisterBuffer, ReleaseBuffer.
target_sources(attnd_client PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/attnclient_ipc.c)
install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/attnclient_shard.h DESTINATION include/attnd)

# The Python package's version, next to the generated attnd_pb2.py, for the
# source tree (PYTHONPATH=$BUILD/python:client/python): the same project
# version the wheel (client/python/setup.py) and the Debian package carry.
file(CONFIGURE OUTPUT ${ATTND_PY_DIR}/attnd_version.py
     CONTENT "\"\"\"Written by CMake: the attnd project version.\"\"\"\n__version__ = \"${PROJECT_VERSION}\"\n"
     @ONLY)
