# CPack post-build script (CPACK_POST_BUILD_SCRIPTS): repacks the -dbgsym
# package the way dh_strip makes one.
#
# CPack 3.25 writes the .ddeb's md5sums with the absolute paths of its staging
# directory, and gives it no /usr/share/doc entry; lintian then reports
# md5sums-lists-nonexistent-file, no-copyright-file and no-changelog. Debian's
# own dbgsym packages carry usr/share/doc/<package>-dbgsym as a symlink to the
# main package's directory (it Depends on that exact version), so the repacked
# one does too. Everything else (control, the .build-id debug files) is kept.
foreach(f ${CPACK_PACKAGE_FILES})
  if(NOT f MATCHES "-dbgsym_[^/]*\\.ddeb$")
    continue()
  endif()
  get_filename_component(name ${f} NAME)
  string(REGEX REPLACE "-dbgsym_.*" "" pkg ${name})
  set(tree ${CPACK_TOPLEVEL_DIRECTORY}/dbgsym-repack)
  file(REMOVE_RECURSE ${tree})
  execute_process(COMMAND dpkg-deb -R ${f} ${tree} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "dpkg-deb -R ${f} failed")
  endif()
  file(READ ${tree}/DEBIAN/md5sums sums)
  string(REGEX REPLACE "  [^\n]*/usr/lib/debug/" "  usr/lib/debug/" sums "${sums}")
  file(WRITE ${tree}/DEBIAN/md5sums "${sums}")
  file(MAKE_DIRECTORY ${tree}/usr/share/doc)
  file(CREATE_LINK ${pkg} ${tree}/usr/share/doc/${pkg}-dbgsym SYMBOLIC)
  execute_process(COMMAND dpkg-deb --root-owner-group -Zxz --build ${tree} ${f}
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "dpkg-deb --build ${tree} failed")
  endif()
  file(REMOVE_RECURSE ${tree})
  message(STATUS "attnd: repacked ${name} (relative md5sums, usr/share/doc/${pkg}-dbgsym)")
endforeach()
