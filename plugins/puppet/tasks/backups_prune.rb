#!/usr/bin/env ruby
# frozen_string_literal: true

# Bolt task vmhost::backups_prune: see tasks/backups_prune.json. Bolt gives the input as JSON on stdin;
# the shared code comes with the task's files (_installdir), or from this module's lib when
# the script is run from the module itself.
require 'json'

input = $stdin.read
dir = begin
  JSON.parse(input)['_installdir']
rescue JSON::ParserError, TypeError
  nil
end
require File.join(dir ? File.join(dir, 'vmhost', 'lib') : File.expand_path('../lib', __dir__), 'puppet_x/vmhost/task')
PuppetX::Vmhost::Task.main('backups_prune', input)
