# frozen_string_literal: true

# What the catalog-run tests (test_provider.rb, test_image.rb) share: Puppet initialised
# with its settings in a throwaway directory, the module's lib on the load path, and the
# PuppetRun mixin. Not a test itself (check.sh runs tests/test_*.rb).
require 'minitest/autorun'
require 'fileutils'
require 'tmpdir'
require 'puppet'
require_relative 'fake_vmhostd'

$LOAD_PATH.unshift(File.expand_path('../lib', __dir__))
PUPPET_DIR = Dir.mktmpdir('vmhpuppet')
Minitest.after_run { FileUtils.remove_entry(PUPPET_DIR) }
Puppet.initialize_settings(['--confdir', PUPPET_DIR, '--vardir', PUPPET_DIR, '--codedir', PUPPET_DIR,
                            '--rundir', PUPPET_DIR, '--logdir', PUPPET_DIR])

# Puppet's log collected in @logs, a FakeVmhostd (@fake) answering every request with the
# test's #handle(req), and one resource applied in a real (in-process) catalog. A test class
# that keeps state for #handle sets it in its own setup before calling super.
module PuppetRun
  def setup
    @logs = []
    Puppet::Util::Log.newdestination(Puppet::Test::LogCollector.new(@logs))
    Puppet::Util::Log.level = :info
    @fake = FakeVmhostd.new { |req| handle(req) }
  end

  def teardown
    Puppet::Util::Log.close_all
    @fake&.close
  end

  # Applies one resource of `type_name` talking to the fake daemon (unless attrs name another
  # socket) and returns its resource status.
  def apply_resource(type_name, noop: false, **attrs)
    catalog = Puppet::Resource::Catalog.new
    res = Puppet::Type.type(type_name).new({ socket: @fake.path }.merge(attrs))
    res[:noop] = true if noop
    catalog.add_resource(res)
    catalog.apply.report.resource_statuses.values.first
  end

  def logs_text
    @logs.map(&:to_s).join("\n")
  end

  # Runs the block with $VMHOST_SOCKET set to the fake daemon (the default socket, what
  # `instances` reads), then puts the variable back as it was.
  def with_default_socket
    old = ENV.fetch('VMHOST_SOCKET', nil)
    ENV['VMHOST_SOCKET'] = @fake.path
    yield
  ensure
    old.nil? ? ENV.delete('VMHOST_SOCKET') : ENV['VMHOST_SOCKET'] = old
  end
end
